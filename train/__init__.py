"""The demo-model recipe: corpus, tokenizer, joint MTP training, distillation, HF export.

Entry point: ``train.cli.main(argv)`` (``python -m train``; ``mtpserve train``).
"""
