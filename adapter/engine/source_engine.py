"""An engine release read from its source files, without importing it.

`SourceEngine(root)` hands out module objects built from the sources under
`root/sglang/...` (an unpacked wheel, a site-packages folder, or a wheel file that is
unpacked first): classes with their own methods and, as bases, their bases read from the
same tree, functions and methods with their real signatures (as `__signature__`),
msgspec struct and dataclass fields in order (inherited ones first, as msgspec and
dataclasses collect them along the MRO), module-level names, names bound by `from ... import ...` resolved through the same
tree, and `__file__` pointing at the real source so that call sites can be read.
Nothing of the engine runs. The adapters' `check(module)` runs unchanged on these.

What this cannot see: anything computed at import or run time (attributes set in
`__init__`, decorators that replace a function, values of module constants), and bases
from outside the tree (their methods and fields).

What it reads is untrusted input: only regular files, within size limits (MEMBER_LIMIT,
TOTAL_LIMIT); anything else is an `EngineSourceError`, one line for the user.
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import pathlib
import re
import shutil
import stat
import types
import zipfile
import zlib
from collections.abc import Mapping
from typing import NamedTuple, Optional

from . import syntax
from .files import python_files

# sglang 0.5.16-0.5.23: the largest .py file is 444 KB (0.5.18 server_args.py), all .py
# files of 0.5.23 together 68 MB (growing about 8% a release); the limits leave 9x and
# about 4x headroom, and bound what a crafted wheel can make doctor write or read.
MEMBER_LIMIT = 4 << 20
TOTAL_LIMIT = 256 << 20
_CHUNK = 1 << 20


class EngineSourceError(ValueError):
    """The engine given to `doctor --engine` cannot be read safely or at all."""


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.0f} MiB"


class SourceOnly:
    """A value known only by its name in the source (and, where it is assigned there, by
    the expression it is assigned)."""

    def __init__(self, where: str, node: Optional[ast.expr] = None):
        self.where, self._node = where, node

    @property
    def expression(self) -> Optional[str]:
        return ast.unparse(self._node) if self._node is not None else None

    def __repr__(self) -> str:
        return f"<source-only {self.where}>"


def _value(node, where: str):
    """A literal's value (ints, strings, tuples of them), else a SourceOnly marker."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return SourceOnly(where, node)


class _Default:
    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _signature(args: ast.arguments) -> inspect.Signature:
    P = inspect.Parameter
    params = []
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for index, (arg, default) in enumerate(zip(positional, defaults)):
        kind = P.POSITIONAL_ONLY if index < len(args.posonlyargs) else P.POSITIONAL_OR_KEYWORD
        params.append(P(arg.arg, kind, default=P.empty if default is None else _Default(ast.unparse(default))))
    if args.vararg:
        params.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        params.append(P(arg.arg, P.KEYWORD_ONLY, default=P.empty if default is None else _Default(ast.unparse(default))))
    if args.kwarg:
        params.append(P(args.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


@functools.lru_cache(maxsize=16)
def _lines(text: str) -> list:
    """The text's lines as ast.get_source_segment splits them (no form feeds)."""
    return re.findall(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$", text)


def _segment(text: str, node) -> str:
    """ast.get_source_segment, without splitting the whole text for every node."""
    lines, first, last = _lines(text), node.lineno - 1, node.end_lineno - 1
    if first == last:
        return lines[first].encode()[node.col_offset:node.end_col_offset].decode()
    head = lines[first].encode()[node.col_offset:].decode()
    tail = lines[last].encode()[:node.end_col_offset].decode()
    return "".join([head, *lines[first + 1:last], tail])


def _function(node, module_name: str, qualname: str, text: str):
    def source_only(*args, **kwargs):
        raise RuntimeError(f"{module_name}.{qualname} was read from source and cannot run")

    source_only.__name__, source_only.__qualname__, source_only.__module__ = node.name, qualname, module_name
    source_only.__signature__ = _signature(node.args)
    source_only.__source_text__ = _segment(text, node)
    source_only.__source_line__ = node.lineno  # where that text starts in the file (its def line)
    decorators = {ast.unparse(d) for d in node.decorator_list}
    if "staticmethod" in decorators:
        return staticmethod(source_only)
    if "classmethod" in decorators:
        return classmethod(source_only)
    if "property" in decorators:
        return property(source_only)
    return source_only


def _class(node: ast.ClassDef, module_name: str, text: str, prefix: str = "", resolve=lambda base: None):
    """The class `node` defines, with its own methods and, as bases, those of its bases that
    `resolve` (a base's expression -> a class read from the same tree, or None) finds."""
    qualname = prefix + node.name
    namespace = {"__module__": module_name, "__qualname__": qualname}
    fields = []
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            namespace[item.name] = _function(item, module_name, f"{qualname}.{item.name}", text)
        elif isinstance(item, ast.ClassDef):
            namespace[item.name] = _class(item, module_name, text, qualname + ".", resolve)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            if not ast.unparse(item.annotation).startswith(("ClassVar", "typing.ClassVar")):
                fields.append(item.target.id)
            namespace[item.target.id] = SourceOnly(f"{qualname}.{item.target.id}")
        elif isinstance(item, ast.Assign):
            for target in item.targets:
                if isinstance(target, ast.Name) and not target.id.startswith("__"):  # e.g. __slots__
                    namespace[target.id] = _value(item.value, f"{qualname}.{target.id}")
    names = [ast.unparse(b) for b in node.bases]
    namespace["__source_bases__"] = tuple(names)
    bases = tuple(dict.fromkeys(found for found in map(resolve, node.bases) if found is not None))
    try:
        cls = type(node.name, bases, namespace)
    except TypeError:  # bases Python itself could not order: their methods and fields are not seen
        cls = type(node.name, (), namespace)
    # Fields as msgspec and dataclasses collect them: the bases' from the farthest in the MRO,
    # then the class's own; a field redefined keeps its first place.
    if any(n.split(".")[-1] == "Struct" for n in names) or hasattr(cls, "__struct_fields__"):
        cls.__struct_fields__ = _fields(cls, "__struct_fields__", fields)
    if any(ast.unparse(d).split("(")[0].split(".")[-1] == "dataclass" for d in node.decorator_list):
        cls.__dataclass_fields__ = dict.fromkeys(_fields(cls, "__dataclass_fields__", fields))
    return cls


def _fields(cls, kind: str, own: list) -> tuple:
    found = {}
    for base in reversed(cls.__mro__[1:]):
        found.update(dict.fromkeys(vars(base).get(kind, ())))
    found.update(dict.fromkeys(own))
    return tuple(found)


def _source_class(module, base: ast.expr):
    """The class a base's expression (`Name`, `package.Name`) names in `module`, where it is a
    class read from the same tree; None for anything else (msgspec.Struct, Generic[T])."""
    found, parts = module, ast.unparse(base).split(".")
    if not all(part.isidentifier() for part in parts):
        return None
    for part in parts:
        found = getattr(found, part, None)  # a name imported from the tree resolves here
    return found if isinstance(found, type) and "__source_bases__" in vars(found) else None


class _Imported:
    """`from source import attr`, resolved when first read (import cycles stay harmless)."""

    def __init__(self, engine: "SourceEngine", source: str, attr: str):
        self.engine, self.source, self.attr = engine, source, attr

    def resolve(self):
        module = self.engine.module(self.source)
        if module is not None:
            try:
                return getattr(module, self.attr)
            except AttributeError:
                pass
        submodule = self.engine.module(f"{self.source}.{self.attr}")
        return submodule if submodule is not None else SourceOnly(f"{self.source}.{self.attr}")


class SourceModule(types.ModuleType):
    """A module read from source; imported names resolve on first access."""

    def __getattribute__(self, name):
        value = super().__getattribute__(name)
        if isinstance(value, _Imported):
            value = value.resolve()
            setattr(self, name, value)
        return value

    def __getattr__(self, name):
        # Names a `from x import *` brings in, looked up in x when asked for.
        for source in super().__getattribute__("__star_sources__"):
            module = self.__engine__.module(source)
            if module is not None and not name.startswith("_") and hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")


class SourceEngine:
    """The modules of one engine release, read from `root` (which holds `sglang/`)."""

    def __init__(self, root, version: Optional[str] = None, origin=None):
        """`version`: a label given by the caller instead of the tree's own; `origin`: what
        the user named (a wheel unpacked into `root`), for saying where the engine came from."""
        self.root = pathlib.Path(root)
        if not (self.root / "sglang").is_dir():
            raise EngineSourceError(f"{self.root} holds no sglang/ source tree")
        check_tree(self.root / "sglang")
        self.label = read_label(self.root) if version is None else Label(version, None)
        self.version = self.label.version
        self.origin = pathlib.Path(origin or self.root)
        self._modules: dict[str, types.ModuleType] = {}

    def path(self, name: str) -> Optional[pathlib.Path]:
        base = self.root.joinpath(*name.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def files(self) -> Mapping[str, str]:
        """Module name -> path of every .py file under root/sglang."""
        return python_files(self.root)

    def module(self, name: str) -> Optional[types.ModuleType]:
        if name in self._modules:
            return self._modules[name]
        path = self.path(name)
        if path is None:
            return None
        text = path.read_text(encoding="utf-8")
        try:  # one parse per process of each text, whichever engine or check reads it (syntax.parse)
            tree = syntax.parse(text)
        except SyntaxError:
            tree = ast.parse(text, filename=str(path))  # raised again, naming the file (and every time it is asked)
        module = SourceModule(name)
        module.__file__ = str(path)
        module.__engine__ = self
        module.__star_sources__ = []
        self._modules[name] = module  # before its names are bound: a module of the tree that imports it back finds it
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in tree.body:
            self._bind(module, node, package, text)
        return module

    def _bind(self, module, node, package: str, text: str) -> None:
        name = module.__name__
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            setattr(module, node.name, _function(node, name, node.name, text))
        elif isinstance(node, ast.ClassDef):
            setattr(module, node.name, _class(node, name, text, resolve=lambda base: _source_class(module, base)))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    # `Old = New`: an alias of a class, function or import bound above, as Python binds it
                    bound = (module.__dict__.get(node.value.id) if isinstance(node.value, ast.Name) else None)
                    aliased = bound is not None and not isinstance(bound, SourceOnly) and (
                        isinstance(bound, (type, _Imported)) or callable(bound))
                    setattr(module, target.id, bound if aliased else _value(node.value, f"{name}.{target.id}"))
        elif isinstance(node, ast.ImportFrom):
            source = imported_from(node, package)
            for alias in node.names:
                if alias.name == "*":
                    module.__star_sources__.append(source)
                elif source.split(".")[0] == "sglang":
                    setattr(module, alias.asname or alias.name, _Imported(self, source, alias.name))
                else:
                    setattr(module, alias.asname or alias.name, SourceOnly(f"{source}.{alias.name}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                setattr(module, alias.asname or alias.name.split(".")[0], SourceOnly(f"module {alias.name}"))
        elif isinstance(node, ast.If):  # e.g. TYPE_CHECKING or platform branches: take both sides
            for child in node.body + node.orelse:
                self._bind(module, child, package, text)
        elif isinstance(node, ast.Try):
            for child in node.body:
                self._bind(module, child, package, text)


def imported_from(node: ast.ImportFrom, package: str) -> str:
    """The module a `from ... import` names, a relative one resolved against `package` (the
    importing module's package)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


# A release as the registry publishes it (0.5.23, 0.5.23.post1); anything else (0.0.0.dev0,
# 0.5.24rc1, a commit, "unknown") is a build nobody released under that name.
RELEASE = re.compile(r"\d+\.\d+\.\d+(?:\.post\d+)?")
UNRELEASED = "unreleased build, judged by its code"
_VERSION = re.compile(r"""__version__\s*(?::\s*str\s*)?=\s*(?:\w+\s*=\s*)*['"]([^'"]+)['"]""")


class Label(NamedTuple):
    """An engine's version as its own files state it. Only a label: every verdict is
    judged from the engine's code, never from this."""

    version: str  # "unknown" when the tree states none
    source: Optional[str]  # where it was read, relative to the folder holding sglang/

    @property
    def released(self) -> bool:
        return released(self.version)


def released(version: str) -> bool:
    return RELEASE.fullmatch(version) is not None


def read_label(root: pathlib.Path) -> Label:
    """The version of the sglang/ tree under `root`, in the order the engine's own
    sglang/version.py finds it: its generated _version.py, else the distribution metadata
    (only a dist-info beside the tree whose RECORD lists this tree's files: another
    installation's metadata would label this tree with its own version), else the literal
    version.py falls back to."""
    root = pathlib.Path(root)
    found = _version_in(root / "sglang" / "_version.py")
    if found:
        return Label(found, "sglang/_version.py")
    for dist in sorted(root.glob("sglang-*.dist-info")):
        record = small_text(dist / "RECORD")
        if record is not None and re.search(r"^sglang/__init__\.py,", record, re.M):
            metadata = small_text(dist / "METADATA") or ""
            found = re.search(r"^Version:\s*(\S+)", metadata, re.M)
            return Label(found.group(1) if found else dist.name[len("sglang-"):-len(".dist-info")], dist.name)
    found = _version_in(root / "sglang" / "version.py")
    return Label(found, "sglang/version.py") if found else Label("unknown", None)


def _version_in(path: pathlib.Path) -> Optional[str]:
    text = small_text(path)
    found = _VERSION.search(text) if text is not None else None
    return found.group(1) if found else None


def small_text(path: pathlib.Path) -> Optional[str]:
    """A regular file's text (a link to one counts) within MEMBER_LIMIT, else None (a FIFO
    would hang the reader)."""
    try:
        mode = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(mode.st_mode) or mode.st_size > MEMBER_LIMIT:
        return None
    return path.read_text(encoding="utf-8", errors="replace")


def check_tree(tree: pathlib.Path) -> None:
    """Every .py file under `tree` is a regular file within the limits, and no folder in it
    is a link: a FIFO would hang a reader, a device or a huge file exhaust it. Refused,
    not skipped: a source the checks cannot read is one they cannot clear."""
    total = 0
    for folder, dirs, files in os.walk(tree):
        for name in dirs:
            if os.path.islink(os.path.join(folder, name)):
                raise EngineSourceError(f"{os.path.join(folder, name)} is a symbolic link: doctor --engine reads only "
                                        "regular files in real folders; copy the engine without links")
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            mode = os.lstat(path)
            if not stat.S_ISREG(mode.st_mode):
                kind = "a symbolic link" if stat.S_ISLNK(mode.st_mode) else "not a regular file (FIFO, device or socket)"
                raise EngineSourceError(f"{path} is {kind}: doctor --engine reads only regular files")
            if mode.st_size > MEMBER_LIMIT:
                raise EngineSourceError(f"{path} is {mode.st_size} bytes, over the per-file limit of "
                                        f"{_mib(MEMBER_LIMIT)} (adapter.engine.source_engine.MEMBER_LIMIT)")
            total += mode.st_size
            if total > TOTAL_LIMIT:
                raise EngineSourceError(f"the .py files under {tree} exceed the total limit of "
                                        f"{_mib(TOTAL_LIMIT)} (adapter.engine.source_engine.TOTAL_LIMIT)")


# Kernel sources an adapter reads (known_bad_config: the DeepSeek-V4 compress write plan),
# unpacked beside the Python ones so that a verdict read from a wheel can rest on them.
KERNEL_SOURCES = ("/csrc/deepseek_v4/c_plan.cuh",)


def _wanted(info: zipfile.ZipInfo) -> bool:
    """The engine's sources (its Python, and the kernel sources adapters read) and its
    distribution metadata (the version, and the RECORD that ties it to these sources); no
    binaries."""
    name = info.filename
    return not info.is_dir() and (
        (name.startswith("sglang/") and name.endswith((".py", *KERNEL_SOURCES)))
        or (name.count("/") == 1 and name.endswith((".dist-info/METADATA", ".dist-info/RECORD"))))


def unpack_wheel(wheel, into) -> pathlib.Path:
    """Unpack the Python sources and metadata of an sglang wheel (not its binaries), as
    regular files, never writing more than MEMBER_LIMIT per member or TOTAL_LIMIT in all
    (counted while writing: the sizes an archive declares may lie)."""
    wheel, into = pathlib.Path(wheel), pathlib.Path(into)
    total = 0
    try:
        with zipfile.ZipFile(wheel) as archive:
            for info in filter(_wanted, archive.infolist()):
                parts = pathlib.PurePosixPath(info.filename).parts
                if ".." in parts or "\\" in info.filename:
                    raise EngineSourceError(f"{wheel}: member {info.filename!r} points outside the wheel")
                if stat.S_ISLNK(info.external_attr >> 16):
                    raise EngineSourceError(f"{wheel}: member {info.filename} is a symbolic link: "
                                            "doctor --engine reads only regular files")
                target = into.joinpath(*parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(info) as source, open(target, "wb") as out:
                    written = 0
                    while chunk := source.read(_CHUNK):
                        written += len(chunk)
                        if written > MEMBER_LIMIT:
                            raise EngineSourceError(f"{wheel}: member {info.filename} unpacks to more than the per-member "
                                                    f"limit of {_mib(MEMBER_LIMIT)} (adapter.engine.source_engine.MEMBER_LIMIT)")
                        if total + written > TOTAL_LIMIT:
                            raise EngineSourceError(f"{wheel}: its .py members unpack to more than the total limit of "
                                                    f"{_mib(TOTAL_LIMIT)} (adapter.engine.source_engine.TOTAL_LIMIT)")
                        out.write(chunk)
                total += written
    except EngineSourceError:
        raise
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, ValueError, OSError) as exc:
        raise EngineSourceError(f"{wheel} is not a readable wheel: {type(exc).__name__}: {exc}") from None
    return into


def open_engine(path, workdir) -> SourceEngine:
    """A wheel file (unpacked into `workdir`) or a folder holding `sglang/`."""
    path = pathlib.Path(path)
    if not os.path.lexists(path):
        raise EngineSourceError(f"{path} does not exist: give an sglang wheel or a folder holding sglang/")
    if path.is_dir():
        return SourceEngine(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise EngineSourceError(f"{path} cannot be read: {exc.strerror}") from None
    if not stat.S_ISREG(mode):
        raise EngineSourceError(f"{path} is neither a regular file nor a folder: give an sglang wheel or a folder holding sglang/")
    into = pathlib.Path(workdir) / path.stem
    try:
        return SourceEngine(unpack_wheel(path, into), origin=path)
    except EngineSourceError:
        shutil.rmtree(into, ignore_errors=True)  # what was written so far goes at once
        raise
