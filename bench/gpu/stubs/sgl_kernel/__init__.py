"""Placeholder sgl_kernel for importing sglang's Python modules on a GPU box without the
real kernel wheel (nothing on the folded-accept path calls it). Any attribute is a
callable that raises if called; any submodule resolves to another placeholder. The file
names no package: setup.sh copies it as 0.5.18's flashinfer placeholder too."""
import importlib.abc, importlib.machinery, sys, types

__version__ = "0.0.0-placeholder"


class _Missing:
    def __init__(self, name):
        self._name = name

    def __call__(self, *a, **k):
        raise RuntimeError(f"{__name__} placeholder: {self._name} called")

    def __getattr__(self, item):
        return _Missing(f"{self._name}.{item}")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(name)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = types.ModuleType(spec.name)
        m.__path__ = []
        m.__getattr__ = lambda n: (_ for _ in ()).throw(AttributeError(n)) if n.startswith("__") else _Missing(f"{spec.name}.{n}")
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
