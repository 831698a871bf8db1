"""Suite-wide order: the modules with the most slow tests run first; one kept random init folder per config.

`make test` runs the suite on two pytest-xdist workers (`--dist worksteal`): each starts on its share of the
tests in collection order and takes tests from the end of the other's share once idle. Long end-to-end modules
first, short ones last, so the short ones are what gets balanced at the end rather than one long module left
running alone; tests of one module stay mostly on one worker, so its module fixtures seldom run twice.

The runs of the tiny configs build a random init folder each (model.path empty): HYBRIDRL_INIT_CACHE, set here to
a folder of this session (both workers share it), lets every run after the first copy that build
(tests/test_init_folder.py checks a copy equals a build).
"""
import collections
import os

import pytest


def pytest_collection_modifyitems(config, items):
    slow = collections.Counter(item.module.__name__ for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.module.__name__])  # stable: order within a module is kept


@pytest.fixture(scope="session", autouse=True)
def _kept_init_folders(tmp_path_factory):
    from hybridrl.trainer.roles import INIT_CACHE_ENV

    base = tmp_path_factory.getbasetemp()
    session = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the workers' shared folder
    os.environ.setdefault(INIT_CACHE_ENV, str(session / "kept_init"))
    yield
