"""Benchmarks of mtpserve: offline engine sweep, serving load test, cost, reports.

``mtpserve bench offline|serve|report`` (see ``bench/cli.py``); the method is the one in the
project's BENCHMARKS.md: correctness first, side-by-side ratios, median and spread, a floor on GPU.
Results live in ``bench/results/`` as JSON, with a markdown table and PNG plots made from it.
"""
