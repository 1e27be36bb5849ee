"""Run a callback right after a module finishes importing.

Why: verl loads plugins while `import verl` is still running, and the modules
we wire into (verl's Megatron engine, mbridge) pull in megatron-core and take
seconds to import. Importing them eagerly would slow every verl process,
including FSDP-only ones; waiting for the process to import them itself costs
nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from collections.abc import Callable

_lock = threading.Lock()


class _AfterImportLoader(importlib.abc.Loader):
    def __init__(self, loader, finder: _AfterImportFinder):
        self._loader = loader
        self._finder = finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        # If this raises (the module or the callback), the import fails as a whole and the finder
        # stays in place, so the next import runs the callback again: never a module without it.
        self._loader.exec_module(module)
        self._finder.callback(module)
        self._finder.retire()

    def __getattr__(self, name):  # get_code, get_source, is_package, ... of the real loader
        return getattr(self._loader, name)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, callback: Callable):
        self.name = name
        self.callback = callback
        self._searching = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self._searching:
            return None
        self._searching = True  # keeps the find_spec below from finding us again
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._searching = False
        if spec is not None and spec.loader is not None:
            spec.loader = _AfterImportLoader(spec.loader, self)
        return spec

    def retire(self) -> None:
        """Leave sys.meta_path once the callback has run on the imported module."""
        with _lock:
            if self in sys.meta_path:
                sys.meta_path.remove(self)


def when_imported(name: str, callback: Callable) -> None:
    """Call callback(module) now if `name` is imported, else right after its import finishes."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            if any(
                isinstance(f, _AfterImportFinder) and f.name == name and f.callback is callback for f in sys.meta_path
            ):
                return
            sys.meta_path.insert(0, _AfterImportFinder(name, callback))
            return
    callback(module)
