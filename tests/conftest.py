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


@pytest.fixture(autouse=True)
def training_cache_of_the_tests(tmp_path_factory):
    """The trainers' caches (the pool's states among them) go to a folder of the test session's, never the
    user's: a test that answers the pool would otherwise record states there. A patch of its own, which a test's
    ``monkeypatch.undo()`` leaves in place."""
    from specdemo.training import common

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(common, "CACHE_HOME", tmp_path_factory.getbasetemp() / "training-cache")
        yield


def need_browser(chromium: str, allow_module_level: bool = False):
    """Playwright's sync API when Playwright and Chromium are here; otherwise skip, or fail where a browser is
    required (``SPECDEMO_REQUIRE_BROWSER=1``, as ``.ci/run`` sets it)."""
    import importlib
    import os

    reason = None
    try:
        sync_api = importlib.import_module("playwright.sync_api")
    except ImportError:
        sync_api, reason = None, "Playwright for Python is not installed: pip install playwright"
    if reason is None and not (os.path.isfile(chromium) and os.access(chromium, os.X_OK)):
        reason = f"no Chromium at {chromium}: apt-get install -y chromium"
    if reason is not None:
        if os.environ.get("SPECDEMO_REQUIRE_BROWSER") == "1":
            pytest.fail(f"a browser test cannot run: {reason}", pytrace=False)
        pytest.skip(reason, allow_module_level=allow_module_level)
    return sync_api
