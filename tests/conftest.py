"""Suite-wide order: the modules with the most slow tests run first.

`make test` runs the suite on two pytest-xdist workers, each taking whole modules in collection order
(`--dist loadscope`, so a module's shared fixtures run once). Starting with the long end-to-end modules
lets the short ones fill in beside them, instead of one long module running alone at the end.
"""
import collections


def pytest_collection_modifyitems(config, items):
    slow = collections.Counter(item.module.__name__ for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.module.__name__])  # stable: order within a module is kept
