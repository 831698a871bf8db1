"""Suite-wide order: the modules with the most slow tests run first.

`make test` runs the suite on two pytest-xdist workers (`--dist worksteal`): each starts on its share of the
tests in collection order and takes tests from the end of the other's share once idle. Long end-to-end modules
first, short ones last, so the short ones are what gets balanced at the end rather than one long module left
running alone; tests of one module stay mostly on one worker, so its module fixtures seldom run twice.
"""
import collections


def pytest_collection_modifyitems(config, items):
    slow = collections.Counter(item.module.__name__ for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.module.__name__])  # stable: order within a module is kept
