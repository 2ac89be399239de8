from pathlib import Path

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def e2e_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The lead's ``tiny_model_dir`` (tests/conftest.py) when it exists; until then a tiny random
    checkpoint from tests/model_factory.py with a character-level tokenizer."""
    try:
        return Path(request.getfixturevalue("tiny_model_dir"))
    except pytest.FixtureLookupError:
        pass
    from tests.app.tiny_tokenizer import write_char_tokenizer
    from tests.model_factory import build_checkpoint

    folder = build_checkpoint(tmp_path_factory.mktemp("e2e-model"), seed=3)
    write_char_tokenizer(folder, vocab_size=96, bos_id=0, eos_id=1)
    return folder
