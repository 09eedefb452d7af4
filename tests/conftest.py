import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module that serves the app on tiny models (see ``tiny_app.one_thread``)."""
    import tiny_app

    with tiny_app.one_thread():
        yield


@pytest.fixture
def own_cache(tmp_path_factory, monkeypatch):
    """Calibrations of tiny models go to a folder of the test's, not the user's cache (``SPECDEMO_CACHE``); for
    modules that run the bench or recorder CLIs, whose tests calibrate."""
    monkeypatch.setenv("SPECDEMO_CACHE", str(tmp_path_factory.mktemp("cache")))
