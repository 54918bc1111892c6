"""Module fixtures that make each case's work when a test first asks for it."""

from __future__ import annotations


class OnFirstUse(dict):
    """Name -> what `make(name)` made, made by the first test that asks: a test's timeout then
    bounds one case's work (one tree judged, one release's table), whichever test runs first."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, name):
        self[name] = made = self.make(name)
        return made
