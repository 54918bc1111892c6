"""Following a value through the engine's code, read from its sources: where it is kept, what
reads it, and every place the following cannot see past.

A proof that no code reads something must follow the value, not names: a call graph resolved by
name reaches most of the engine from the scheduler. Here a value is followed from where it is
born (a `Question` says where: a call, an attribute read) through what Python would do with it:
locals, returns, the attributes and containers it is kept in, the functions and methods it is
passed to. Each callee is the one that runs, found as Python finds it: `self.m` on the class's
own MRO (read from source, bases followed through imports, aliases and re-exports); `self.x.m`
on the class `self.x` is built as, followed from its construction site (a class called by name,
or handed in by the builder's keyword, or a container); a module-level name through imports to
its `def` or `class`. Values kept in an attribute are followed into every method of the class
that reads that attribute (`self.result_queue`, then its items popped elsewhere).

Anything the following cannot resolve where the value (or an object holding it) goes is a gap,
named with its file, line and function: passed to code outside the engine or to a callee it
cannot find, formatted as text, compared by value, read by a name made at run time, stored where
it is not followed, a callee wrapped by a decorator that is not known to call it plainly. A
proof holds only with no gap. The following is flow-insensitive (every statement of a function
counts, in any order) and path-insensitive: it may find a read that never runs, never miss one
it can see.

What it does not see, said so that a proof is read for what it is: code that is not Python of the
engine's sources (an extension module handed the value is a gap, one that reaches it by itself is
not seen), and objects two steps from the value (an object of a class that keeps the value in one
of its own attributes is followed as a holder; one that only holds such an object is not). The
run-time side of a proof (folded_fence.logits_readers' watch) covers what the first steps run.
"""

from __future__ import annotations

import ast
import builtins
import collections
import functools
import hashlib
from typing import Callable, NamedTuple, Optional

from . import syntax
from .source_engine import imported_from

E = frozenset()
_HOPS = 16
# Calls that neither read a value's attributes nor keep it (a value's own identity and type).
HARMLESS = frozenset({"len", "isinstance", "issubclass", "id", "type", "hasattr", "callable", "bool"})
# Builtins that hand back a container's items (iterated, not read).
ITERATING = frozenset({"iter", "next", "list", "tuple", "reversed", "enumerate", "zip", "set", "frozenset"})
# A container's methods that keep what they are given, and those that hand back what it keeps.
ADDING = frozenset({"append", "appendleft", "extend", "extendleft", "insert", "add", "put", "put_nowait",
                    "setdefault", "update"})
TAKING = frozenset({"pop", "popleft", "get", "get_nowait", "copy", "values", "items", "clear"})
CONTAINERS = frozenset({"collections.deque", "collections.OrderedDict", "collections.defaultdict",
                        "queue.Queue", "queue.SimpleQueue", "builtins.list", "builtins.dict", "builtins.set"})
# Bases whose classes take their annotated fields as keywords and run nothing of their own.
FIELD_BASES = frozenset({"msgspec.Struct", "typing.NamedTuple"})
# Decorators that call the function as it is written (or only mark it).
PLAIN_DECORATORS = frozenset({"builtins.staticmethod", "builtins.classmethod", "torch.no_grad", "torch.inference_mode",
                              "functools.wraps", "abc.abstractmethod", "typing.override", "typing.final"})


class Place(NamedTuple):
    """A place in the engine's code: a read the following found there, or (with `why`) a gap, where the
    value goes somewhere the following cannot see past."""
    module: str
    line: int
    function: str
    why: str = ""

    def said(self) -> str:
        where = f"{self.module.replace('.', '/')}.py:{self.line} ({self.function})"
        return f"{where} {self.why}" if self.why else where


# ------------------------------------------------------------------ the engine's sources


class Sources:
    """The engine's modules as syntax trees, and module-level names resolved as Python binds them."""

    def __init__(self, files: dict):
        self.files = files
        self.read: dict = {}  # module -> its file's path, or None where it has none: all a result depends on
        self._trees, self._bindings, self._resolved, self._classes = {}, {}, {}, {}

    def has(self, module: str) -> bool:
        self.read.setdefault(module, self.files.get(module))
        return module in self.files

    def tree(self, module: str) -> Optional[ast.Module]:
        if module not in self._trees:
            self._trees[module] = _parse(self.files[module]) if self.has(module) else None
        return self._trees[module]

    def package(self, module: str) -> str:
        return module if self.has(module) and str(self.files[module]).endswith("__init__.py") else module.rpartition(".")[0]

    def bindings(self, module: str) -> dict:
        """Module-level name -> [(kind, what)]: "def", "class", "import" (module, name),
        "module" (dotted), "alias" (expression); under `if` and `try` both ways, never
        what only a type checker sees."""
        if module in self._bindings:
            return self._bindings[module]
        found = collections.defaultdict(list)
        tree = self.tree(module)

        def visit(body):
            for node in body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[node.name].append(("def", node))
                elif isinstance(node, ast.ClassDef):
                    found[node.name].append(("class", node))
                elif isinstance(node, ast.ImportFrom):
                    source = imported_from(node, self.package(module))
                    for alias in node.names:
                        found[alias.asname or alias.name].append(("import", (source, alias.name)))
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        name = alias.asname or alias.name.split(".")[0]
                        found[name].append(("module", alias.name if alias.asname else name))
                elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                        if isinstance(target, ast.Name):
                            found[target.id].append(("alias", node.value))
                elif isinstance(node, ast.If):
                    if "TYPE_CHECKING" not in ast.unparse(node.test):
                        visit(node.body)
                    visit(node.orelse)
                elif isinstance(node, ast.Try):
                    visit(node.body + node.orelse + [s for h in node.handlers for s in h.body])

        if tree is not None:
            visit(tree.body)
        self._bindings[module] = found
        return found

    def resolve(self, module: str, name: str, hops: int = 0) -> tuple:
        """What `name` is in `module`: ("def", module, node), ("class", module, node),
        ("module", dotted), ("outside", dotted) or ("unknown", why)."""
        key = (module, name)
        if key in self._resolved:
            return self._resolved[key]
        if hops > _HOPS:
            return ("unknown", f"{module}.{name} is reached through more than {_HOPS} names")
        found = self.bindings(module).get(name, []) if self.tree(module) is not None else []
        distinct = {(kind, what if kind != "alias" else ast.unparse(what)) for kind, what in found}
        if not found:
            answer = ("outside", f"builtins.{name}") if hasattr(builtins, name) else (
                "unknown", f"{module} binds no {name}")
        elif len(distinct) > 1:
            answer = ("unknown", f"{module}.{name} is bound {len(found)} ways")
        else:
            kind, what = found[-1]
            if kind in ("def", "class"):
                answer = (kind, module, what)
            elif kind == "import":
                source, attr = what
                if source.split(".")[0] != "sglang":
                    answer = ("outside", f"{source}.{attr}")
                elif self.has(f"{source}.{attr}"):
                    answer = ("module", f"{source}.{attr}")
                else:
                    answer = self.resolve(source, attr, hops + 1)
            elif kind == "module":
                answer = ("module", what) if what.split(".")[0] == "sglang" else ("outside", what)
            elif isinstance(what, (ast.Dict, ast.List, ast.Tuple, ast.Set)):
                answer = ("literal", module, what)  # a table of names: what it holds is followed
            else:
                answer = self.expression(module, what, hops + 1)
        self._resolved[key] = answer
        return answer

    def bound_at(self, module: str, name: str, hops: int = 0) -> tuple:
        """(the module, the expression) a name is bound to by `name = expression`, followed
        through imports; (module, None) for any other binding."""
        found = self.bindings(module).get(name, []) if self.tree(module) is not None else []
        if len(found) != 1 or hops > _HOPS:
            return module, None
        kind, what = found[0]
        if kind == "import" and what[0].split(".")[0] == "sglang":
            return self.bound_at(what[0], what[1], hops + 1)
        return (module, what) if kind == "alias" else (module, None)

    def expression(self, module: str, node: ast.expr, hops: int = 0, name=None) -> tuple:
        """What a name or dotted expression in `module` names (as resolve); `name` resolves its first
        name where a function binds names of its own (an import inside it)."""
        if isinstance(node, ast.Name):
            return name(node.id) if name is not None else self.resolve(module, node.id, hops)
        if isinstance(node, ast.Attribute):
            base = self.expression(module, node.value, hops, name)
            if base[0] == "module":
                return self.resolve(base[1], node.attr, hops + 1)
            if base[0] == "outside":
                return ("outside", f"{base[1]}.{node.attr}")
            if base[0] == "class":
                return ("attribute", self.cls(base[1], base[2]), node.attr)
        if isinstance(node, ast.Call):  # torch.no_grad() as a decorator
            return self.expression(module, node.func, hops, name)
        return ("unknown", f"{ast.unparse(node)} is computed")

    def cls(self, module: str, node: ast.ClassDef) -> "Class":
        key = (module, node.lineno, node.name)
        if key not in self._classes:
            self._classes[key] = Class(self, module, node)
        return self._classes[key]

    def class_named(self, module: str, name: str) -> Optional["Class"]:
        found = self.resolve(module, name)
        return self.cls(found[1], found[2]) if found[0] == "class" else None


_PARSED: dict = {}  # sha256 of a file's text -> its tree: one parse per text in this process


def _parse(path) -> Optional[ast.Module]:
    with open(path, "rb") as handle:
        data = handle.read()
    key = hashlib.sha256(data).hexdigest()
    if key not in _PARSED:
        _PARSED[key] = syntax.parse(data.decode("utf-8"))
    return _PARSED[key]


class Class:
    """A class of the engine read from source: its own methods and annotated fields, its MRO."""

    def __init__(self, sources: Sources, module: str, node: ast.ClassDef):
        self.sources, self.module, self.node, self.name = sources, module, node, node.name
        self.methods = {n.name: n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.fields = [n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                       and "ClassVar" not in ast.unparse(n.annotation)]
        self.assigned = {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        self._mro = None

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"

    def bases(self) -> list:
        """Each base: a Class, or the dotted name of one outside the engine's sources ("?" + the
        expression where it cannot be followed)."""
        found = []
        for base in self.node.bases:
            what = self.sources.expression(self.module, base.value if isinstance(base, ast.Subscript) else base)
            found.append(self.sources.cls(what[1], what[2]) if what[0] == "class" else
                         what[1] if what[0] == "outside" else f"?{ast.unparse(base)}")
        return [b for b in found if b not in ("builtins.object", "typing.Generic")]

    def mro(self) -> list:
        if self._mro is None:
            self._mro = [self]  # a cycle reads as no further bases
            self._mro = _c3(self)
        return self._mro

    def lookup(self, name: str) -> tuple:
        """("method", owner, node), ("attribute", owner), ("outside", base): where `name` would
        be found first; ("none",) where no class of the sources defines it."""
        for owner in self.mro():
            if not isinstance(owner, Class):
                return ("outside", owner)
            if name in owner.methods:
                return ("method", owner, owner.methods[name])
            if name in owner.fields or name in owner.assigned:
                return ("attribute", owner)
        return ("none",)

    def field_bases(self) -> bool:
        """Built from its annotated fields by keyword: a dataclass or a msgspec struct / NamedTuple with
        no __init__ or __new__ anywhere in its MRO (a __post_init__ is followed where it is built)."""
        for owner in self.mro():
            if not isinstance(owner, Class):
                if owner not in FIELD_BASES:
                    return False
                continue
            if {"__init__", "__new__"} & set(owner.methods):
                return False
            if owner is self and not any("dataclass" in ast.unparse(d) for d in owner.node.decorator_list) and \
                    not any(isinstance(b, str) and b in FIELD_BASES for b in owner.bases()):
                if not any(isinstance(b, Class) and b.field_bases() for b in owner.bases()):
                    return False
        return True

    def all_fields(self) -> list:
        found = []
        for owner in reversed(self.mro()):
            if isinstance(owner, Class):
                found += [f for f in owner.fields if f not in found]
        return found


def _c3(cls: Class) -> list:
    sequences = [b.mro() if isinstance(b, Class) else [b] for b in cls.bases()] + [cls.bases()]
    found, sequences = [cls], [list(s) for s in sequences if s]
    while sequences:
        head = next((s[0] for s in sequences if not any(s[0] in t[1:] for t in sequences)), None)
        if head is None:  # no consistent order (Python would refuse the class): the bases as written
            return [cls] + [b for s in sequences for b in s if b is not cls]
        found.append(head)
        sequences = [t for t in ([x for x in s if x is not head] for s in sequences) if t]
    return found


# ------------------------------------------------------------------ what is followed


class Question(NamedTuple):
    """What is followed, and what counts as reading it.

    born: (function context, node) -> the token a node makes (a call, an attribute read), or None;
    holds: (class, attribute) -> the class of the value a followed value holds there (the result
    holds its logits output); read: (class, attribute) whose load is a read (a test of identity,
    `is None`, is not); kept_is_gap: where the followed value may not outlive the step, keeping it
    in any attribute is a gap rather than followed."""
    born: Callable
    holds: dict
    read: tuple
    kept_is_gap: bool = False


def value(cls: Class) -> tuple:
    """A followed value of class `cls` (the token)."""
    return ("value", cls)


_DEPTH = 3  # containers nested deeper than this are read as one container of everything they hold


def _element(t: frozenset) -> frozenset:
    """A container holding what `t` holds: nested at most _DEPTH deep, so that a value put back
    into its own container (a loop, a recursion) settles instead of nesting without end."""
    return frozenset({("items", _capped(t, _DEPTH))}) if t else E


def _capped(t: frozenset, depth: int) -> frozenset:
    if depth > 0:
        return frozenset(("items", _capped(x[1], depth - 1)) if x[0] == "items" else
                         ("tuple", tuple(_capped(p, depth - 1) for p in x[1])) if x[0] == "tuple" else x for x in t)
    flat = set()
    for x in t:
        if x[0] == "items":
            flat |= _capped(x[1], 0)
        elif x[0] == "tuple":
            for part in x[1]:
                flat |= _capped(part, 0)
        else:
            flat.add(x)
    return frozenset(flat)


class Analysis:
    """The following, from every method of `roots` (classes whose methods may make the value),
    to a fixed point: each function is read again when what it reads (its parameters, the
    attributes it loads, the returns of its callees) changed."""

    def __init__(self, sources: Sources, roots: list, question: Question):
        self.sources, self.question = sources, question
        self.fields = collections.defaultdict(frozenset)    # (class, attribute) -> tokens kept there
        self.params = collections.defaultdict(dict)         # function key -> {parameter: tokens}
        self.returns = collections.defaultdict(frozenset)   # function key -> tokens returned
        self.functions = {}                                 # key -> (class context, module, node)
        self.users = collections.defaultdict(set)           # what changed -> the functions that read it
        self.reads, self.gaps = set(), set()
        self.builders = collections.defaultdict(list)       # class -> [(the class building it, the call, module)]
        self.kept = collections.defaultdict(frozenset)      # class -> what any of its attributes keeps
        self.passing = {}                                   # id(a decorator's wrapper) -> the names it calls through
        self._components, self._assignments, self._decorations = {}, {}, {}
        self._pending, self._queued = collections.deque(), set()
        for root in roots:
            for owner in root.mro():
                if isinstance(owner, Class):
                    for node in owner.methods.values():
                        self.function(root, owner.module, node)

    def decorations(self, module: str, function) -> tuple:
        """([(module, wrapper, names it calls through)], [decorators not shown to pass the
        arguments through]) for a def of `module`: what a call of it runs first."""
        key = (module, id(function))
        if key not in self._decorations:
            wrappers, unplain = [], []
            for decorator in function.decorator_list:
                what = self.sources.expression(module, decorator)
                if (what[1] if what[0] == "outside" else ast.unparse(decorator)) in PLAIN_DECORATORS:
                    continue
                found = wrappers_of(self.sources, module, decorator)
                if found is None:
                    unplain.append(ast.unparse(decorator))
                else:
                    wrappers += found
            self._decorations[key] = (wrappers, unplain)
        return self._decorations[key]

    def function(self, context, module: str, node) -> tuple:
        key = (id(context), module, id(node))  # one parsed text may sit at two module paths (a moved copy)
        if key not in self.functions:
            self.functions[key] = (context, module, node)
            self.enqueue(key)
        return key

    def enqueue(self, key) -> None:
        if key not in self._queued:
            self._queued.add(key)
            self._pending.append(key)

    def changed(self, what) -> None:
        for key in self.users.pop(what, ()):
            self.enqueue(key)

    def run(self) -> "Analysis":
        with syntax.collector_paused():
            while self._pending:
                key = self._pending.popleft()
                self._queued.discard(key)
                _Function(self, key).run()
        return self

    def assignments(self, context: Class) -> dict:
        """attribute -> [(owner, method, assigned value)] for every `self.<attribute> = value` in
        the methods of `context`'s MRO."""
        if context not in self._assignments:
            found = collections.defaultdict(list)
            for owner in context.mro():
                if not isinstance(owner, Class):
                    continue
                for method in owner.methods.values():
                    for attribute, assigned in _self_stores(method):
                        found[attribute].append((owner, method, assigned))
            self._assignments[context] = found
        return self._assignments[context]

    # what a context's attribute is built as
    def components(self, context: Class, field: str):
        """The classes `self.<field>` of `context` is built as (a list), "items" for a container,
        or a string saying why it cannot be told."""
        key = (context, field)
        if key not in self._components:
            self._components[key] = self._built(context, field)
        return self._components[key]

    def _built(self, context: Class, field: str):
        found, container, why = [], False, None
        for owner, method, assigned in self.assignments(context).get(field, ()):
            built = self._construction(owner.module, assigned, context, method)
            if built == "items":
                container = True
            elif isinstance(built, list):
                found += built
            elif built is not None:
                why = f"self.{field} = {ast.unparse(assigned)[:60]}: {built}"
        if why is None and not found and not container and field in context.all_fields():
            found = self._from_builders(context, field) or []
            why = None if found else f"{context.name}.{field} is a field whose builder is not followed"
        if why is not None:
            return why
        if container and not found:
            return "items"
        if container or not found:
            return f"self.{field} is built nowhere in {context.name}'s classes" if not found else \
                f"self.{field} is both a container and an object"
        return list(dict.fromkeys(found))

    def _construction(self, module: str, node, context: Class, method):
        """A list of classes, "items", None (nothing: `= None`), or why it cannot be told."""
        if isinstance(node, ast.Constant) and node.value is None:
            return None
        if isinstance(node, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
            return "items"
        if isinstance(node, ast.Call):
            what = self.sources.expression(module, node.func)
            if what[0] == "class":
                built = self.sources.cls(what[1], what[2])
                self.builders[built].append((context, node, module))
                return [built]
            if what[0] == "outside" and what[1] in CONTAINERS:
                return "items"
            return f"built by {ast.unparse(node.func)} ({what[1]})"
        if isinstance(node, ast.Name) and method.name == "__init__" and node.id in _parameters(method):
            found = self._from_builders(context, node.id)
            return found if found else f"{node.id} is handed in by a builder that is not followed"
        return "not a construction"

    def _from_builders(self, context: Class, keyword: str) -> Optional[list]:
        found = []
        for builder, call, module in self.builders.get(context, ()):
            given = next((k.value for k in call.keywords if k.arg == keyword), None)
            if isinstance(given, ast.Name) and given.id == "self":
                found.append(builder)
            elif isinstance(given, ast.Attribute) and isinstance(given.value, ast.Name) and given.value.id == "self":
                built = self.components(builder, given.attr)
                if not isinstance(built, list):
                    return None
                found += built
            elif isinstance(given, ast.Call):
                built = self._construction(module, given, builder, call)
                if not isinstance(built, list):
                    return None
                found += built
            else:
                return None
        return found or None


def wrappers_of(sources: Sources, module: str, decorator, hops: int = 0) -> Optional[list]:
    """The wrapper functions `decorator` (an expression in `module`) puts around a function, as
    [(module, def)], where each is shown to hand the function its own arguments unchanged and do
    nothing else with them: `def wrapper(self, *args, **kwargs): ... return func(self, *args,
    **kwargs)`, under `@wraps(func)`, made by a decorator (or a factory of one, or a partial of a
    factory) of the engine's sources. None where that is not shown."""
    if hops > _HOPS:
        return None
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    what = sources.expression(module, target)
    if what[0] != "def":
        home, bound = sources.bound_at(module, target.id) if isinstance(target, ast.Name) else (module, None)
        if isinstance(bound, ast.Call) and bound.args and \
                sources.expression(home, bound.func) == ("outside", "functools.partial"):  # partial(factory, ...)
            inner = bound.args[0]
            return wrappers_of(sources, home, ast.Call(func=inner, args=[], keywords=[])
                               if isinstance(decorator, ast.Call) else inner, hops + 1)
        return None
    home, function = what[1], what[2]
    if isinstance(decorator, ast.Call):  # a factory: the decorator is the def it returns
        function = _returned_def(function)
        if function is None:
            return None
    return _decorator_wrappers(sources, home, function, hops)


def _returned_def(function) -> Optional[ast.FunctionDef]:
    """The nested def `function` returns by name (`return inner`, `return cast(T, inner)`)."""
    nested = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
    own = syntax.scoped_nodes(function, enter=lambda n: n is function or not isinstance(n, nested))
    returns = [n for n, _ in own if isinstance(n, ast.Return) and n.value is not None]
    inner = {n.name: n for n in function.body if isinstance(n, ast.FunctionDef)}
    if len(returns) != 1:
        return None
    value = returns[0].value
    if isinstance(value, ast.Call) and ast.unparse(value.func) in ("cast", "typing.cast") and len(value.args) == 2:
        value = value.args[1]
    return inner.get(value.id) if isinstance(value, ast.Name) else None


def _decorator_wrappers(sources: Sources, module: str, decorator, hops: int) -> Optional[list]:
    positional = decorator.args.posonlyargs + decorator.args.args
    if len(positional) != 1 or decorator.args.vararg or decorator.args.kwarg:
        return None
    func = positional[0].arg
    wrapper = _returned_def(decorator)
    if wrapper is None or any(ast.unparse(d) not in (f"wraps({func})", f"functools.wraps({func})")
                              for d in wrapper.decorator_list):
        return None
    found, callees = [], {func}
    for statement in decorator.body:  # `profiled = other_decorator(...)(func)`: followed the same way
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1 and isinstance(statement.targets[0], ast.Name) \
                and isinstance(statement.value, ast.Call) and [ast.unparse(a) for a in statement.value.args] == [func]:
            inner = wrappers_of(sources, module, statement.value.func, hops + 1)
            if inner is None:
                return None
            found += inner
            callees.add(statement.targets[0].id)
    if not _passes_through(wrapper, callees):
        return None
    return found + [(module, wrapper, frozenset(callees))]


def _passes_through(wrapper, callees: set) -> bool:
    """`wrapper` uses its *args and **kwargs only to call one of `callees` with its own
    parameters in order (`f(self, *args, **kwargs)`), and its named parameters only there or
    as the receiver of an attribute."""
    a = wrapper.args
    if a.vararg is None or a.kwarg is None or a.kwonlyargs or len(a.posonlyargs + a.args) > 1:
        return False
    named = [p.arg for p in a.posonlyargs + a.args]
    expected = named + [f"*{a.vararg.arg}", f"**{a.kwarg.arg}"]
    through = set()
    for call in _walk(wrapper):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in callees:
            given = [ast.unparse(x) for x in call.args] + [f"**{ast.unparse(k.value)}" if k.arg is None else "?"
                                                          for k in call.keywords]
            if given != expected:
                return False
            through.update(id(n) for n in _walk(call) if isinstance(n, ast.Name))
    parents = {id(child): parent for parent in _walk(wrapper) for child in ast.iter_child_nodes(parent)}
    for node in _walk(wrapper):
        if isinstance(node, ast.Name) and node.id in (a.vararg.arg, a.kwarg.arg) and id(node) not in through:
            return False
        if isinstance(node, ast.Name) and node.id in named and id(node) not in through:
            parent = parents.get(id(node))
            if not (isinstance(parent, ast.Attribute) and parent.value is node):
                return False
    return bool(through)


def _walk(node) -> list:
    """ast.walk's nodes, in its order, as a list, without its nested generators."""
    nodes, at = [node], 0
    while at < len(nodes):
        current = nodes[at]
        at += 1
        for name in current._fields:
            child = getattr(current, name, None)
            if isinstance(child, ast.AST):
                nodes.append(child)
            elif isinstance(child, list):
                nodes.extend(c for c in child if isinstance(c, ast.AST))
    return nodes


_NAMES: dict = {}  # (module, id(function node)) -> (its local names, its imports): read once per process


def _names(sources: Sources, module: str, function) -> tuple:
    key = (module, id(function))  # relative imports read by the module the text sits at
    if key not in _NAMES:
        shared, local, imported = set(), set(_parameters(function)), {}
        for node in _walk(function):
            if isinstance(node, ast.Name):
                if isinstance(node.ctx, ast.Store):
                    local.add(node.id)
            elif isinstance(node, (ast.Global, ast.Nonlocal)):
                shared.update(node.names)
            elif isinstance(node, ast.ImportFrom):
                source = imported_from(node, sources.package(module))
                for alias in node.names:
                    imported[alias.asname or alias.name] = (source, alias.name)
        _NAMES[key] = (frozenset(local - shared - set(imported)), imported, function)  # the node kept: its id stays its own
    return _NAMES[key][:2]


@functools.cache  # a syntax node is hashed by identity: once per def per process, the node kept
def _marks(function) -> frozenset:
    """A def's decorators as written."""
    return frozenset(ast.unparse(d) for d in function.decorator_list)


@functools.cache  # as _marks
def _self_stores(method) -> tuple:
    """Every `self.<attribute> = value` in `method`, in ast.walk's order, as (attribute, value)."""
    stores = []
    for node in _walk(method):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id == "self":
                    stores.append((target.attr, node.value))
    return tuple(stores)


def _is_super(node) -> bool:
    """`super()`, as written."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super" \
        and not node.args and not node.keywords


def _parameters(node) -> list:
    a = node.args
    return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]


class _Function:
    """One reading of one function, its locals' tokens kept until they settle."""

    def __init__(self, analysis: Analysis, key: tuple):
        self.an, self.key = analysis, key
        self.context, self.module, self.node = analysis.functions[key]
        self.env = collections.defaultdict(frozenset, analysis.params[key])
        positional = [p.arg for p in self.node.args.posonlyargs + self.node.args.args]
        marks = _marks(self.node)
        self.self_name = positional[0] if self.context is not None and positional and "staticmethod" not in marks else None
        if self.self_name is not None:  # the instance, or the class of a classmethod
            self.env[self.self_name] |= frozenset({("class" if "classmethod" in marks else "object", self.context)})
        self.identity = set()  # ids of nodes only tested for identity (`x is None`)
        self.returned = E  # what its return statements (a closure's too) hand back
        # the names bound in the function, and those imported inside it -> what they name
        self.locals, self.imported = _names(self.an.sources, self.module, self.node)
        owner = self.context.name + "." if self.context is not None else ""
        self.where = f"{owner}{self.node.name}"

    def uses(self, what) -> None:
        self.an.users[what].add(self.key)

    def local(self, name: str) -> frozenset:
        self.tick += 1
        self.first_read.setdefault(name, self.tick)
        return self.env.get(name, E)

    def grow(self, name: str, tokens: frozenset) -> None:
        if tokens - self.env.get(name, E):
            self.tick += 1
            self.env[name] = self.env.get(name, E) | tokens
            self.last_grown[name] = self.tick

    def gap(self, node, why: str) -> None:
        self.an.gaps.add(Place(self.module, getattr(node, "lineno", self.node.lineno), self.where, why))

    def run(self) -> None:
        self.uses(("params", self.key))
        for _ in range(8):
            # A pass in which every local was read only after its last change saw each one whole:
            # another would compute the same again.
            self.tick, self.first_read, self.last_grown = 0, {}, {}
            for statement in self.node.body:
                self.statement(statement)
            if not any(self.first_read.get(name, at) < at for name, at in self.last_grown.items()):
                break
        if self.returned - self.an.returns[self.key]:
            self.an.returns[self.key] |= self.returned
            self.an.changed(("returns", self.key))

    # -------------------------------------------------------------- the tokens
    def carries(self, tokens: frozenset, objects: bool = True) -> bool:
        """Whether these tokens hold a followed value: directly, as items, or (with `objects`) as
        an object whose class keeps one in an attribute of its own (one level: an object that
        holds such an object is not a holder itself)."""
        for token in tokens:
            if token[0] == "value":
                return True
            if token[0] == "items" and self.carries(token[1], objects):
                return True
            if token[0] == "tuple" and any(self.carries(t, objects) for t in token[1]):
                return True
            if objects and token[0] in ("object", "built"):
                self.uses(("class", token[1]))
                if self.carries(self.an.kept[token[1]], False):
                    return True
        return False

    def said(self, tokens: frozenset) -> str:
        for token in tokens:
            if token[0] == "value":
                return f"a {token[1].name}"
        return "a holder of one"

    def items(self, tokens: frozenset) -> frozenset:
        found = E
        for token in tokens:
            if token[0] == "items":
                found |= token[1]
            elif token[0] == "tuple":
                found = found.union(*token[1])
        return found

    def at(self, tokens: frozenset, index: int, size: int) -> frozenset:
        found = E
        for token in tokens:
            if token[0] == "tuple" and len(token[1]) == size:
                found |= token[1][index]
            else:
                found |= self.items(frozenset({token}))
        return found

    # -------------------------------------------------------------- statements
    def statement(self, node) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for statement in node.body:  # a closure runs in this function's names
                self.statement(statement)
        elif isinstance(node, ast.Assign):
            tokens = self.value(node.value)
            for target in node.targets:
                self.store(target, tokens)
        elif isinstance(node, ast.AnnAssign):
            if node.value is not None:
                self.store(node.target, self.value(node.value))
        elif isinstance(node, ast.AugAssign):
            self.store(node.target, self.value(node.value) | self.value(node.target))
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            self.store(node.target, self.items(self.value(node.iter)))
            for statement in node.body + node.orelse:
                self.statement(statement)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                tokens = self.value(item.context_expr)
                if item.optional_vars is not None:
                    self.store(item.optional_vars, tokens)
            for statement in node.body:
                self.statement(statement)
        elif isinstance(node, (ast.If, ast.While)):
            self.value(node.test)
            for statement in node.body + node.orelse:
                self.statement(statement)
        elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            for statement in node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]:
                self.statement(statement)
        elif isinstance(node, ast.Match):
            self.value(node.subject)
            for case in node.cases:
                for statement in case.body:
                    self.statement(statement)
        elif isinstance(node, ast.Return):
            self.returned |= self.value(node.value)
        elif isinstance(node, ast.Delete) or isinstance(node, ast.ClassDef):
            pass
        else:  # Expr, Return, Raise, Assert and the statements holding no expression
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    self.value(child)

    def store(self, target, tokens: frozenset) -> None:
        if isinstance(target, ast.Name):
            if target.id not in self.locals and self.carries(tokens):
                self.gap(target, f"keeps {self.said(tokens)} in the module-level name {target.id}, which is not followed")
            self.grow(target.id, tokens)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for index, element in enumerate(target.elts):
                if isinstance(element, ast.Starred):
                    self.store(element.value, _element(self.items(tokens)))
                else:
                    self.store(element, self.at(tokens, index, len(target.elts)))
        elif isinstance(target, ast.Attribute):
            self.keep(target.value, self.value(target.value), target.attr, tokens, target)
        elif isinstance(target, ast.Subscript):
            holder = self.value(target.value)
            self.value(target.slice)
            if tokens:
                self.add(target.value, holder, tokens, target)
        elif isinstance(target, ast.Starred):
            self.store(target.value, tokens)

    def keep(self, holder_node, holder: frozenset, attribute: str, tokens: frozenset, node) -> None:
        """`holder.attribute = tokens`: kept in the attribute of every class the holder may be."""
        if not tokens:
            return
        classes = [t[1] for t in holder if t[0] in ("object", "built", "value")]
        if not classes:
            if self.carries(tokens):
                self.gap(node, f"keeps {self.said(tokens)} in {ast.unparse(holder_node)}.{attribute}, which is not followed")
            return
        if self.an.question.kept_is_gap and self.carries(tokens) and any(t[0] == "object" for t in holder):
            self.gap(node, f"keeps {self.said(tokens)} in {ast.unparse(holder_node)}.{attribute}, beyond the step")
            return
        for cls in classes:
            if tokens - self.an.fields[(cls, attribute)]:
                self.an.fields[(cls, attribute)] |= tokens
                self.an.kept[cls] |= tokens
                self.an.changed(("field", cls, attribute))
                self.an.changed(("class", cls))

    def add(self, holder_node, holder: frozenset, tokens: frozenset, node) -> None:
        """`holder.append(tokens)`, `holder[k] = tokens`: the holder keeps them as items."""
        if isinstance(holder_node, ast.Name):
            if holder_node.id not in self.locals and self.carries(tokens):
                self.gap(node, f"keeps {self.said(tokens)} in the module-level {holder_node.id}, which is not followed")
            self.grow(holder_node.id, _element(tokens))
        elif isinstance(holder_node, ast.Attribute):
            self.keep(holder_node.value, self.value(holder_node.value), holder_node.attr, _element(tokens), node)
        elif isinstance(holder_node, ast.Subscript):
            self.add(holder_node.value, self.value(holder_node.value), _element(tokens), node)
        elif self.carries(tokens):
            self.gap(node, f"keeps {self.said(tokens)} in {ast.unparse(holder_node)}, which is not followed")

    # -------------------------------------------------------------- expressions
    def attribute(self, node: ast.Attribute, base: frozenset) -> frozenset:
        found = E
        born = self.an.question.born(self, node)
        if born is not None:
            found |= frozenset({born})
        for token in base:
            if token[0] not in ("object", "built", "value"):
                if token[0] in ("items", "tuple") and self.carries(frozenset({token})) and node.attr not in ADDING | TAKING:
                    self.gap(node, f"reads .{node.attr} of a holder of a followed value")
                continue
            cls = token[1]
            if token[0] == "value" and (cls, node.attr) == self.an.question.read and id(node) not in self.identity:
                self.an.reads.add(Place(self.module, node.lineno, self.where))
            held = self.an.question.holds.get((cls, node.attr))
            if token[0] == "value" and held is not None:
                found |= frozenset({value(held)})
            self.uses(("field", cls, node.attr))
            found |= self.an.fields[(cls, node.attr)]
            if token[0] == "object" and held is None and not self.an.fields[(cls, node.attr)] \
                    and node.attr in self.an.assignments(cls):
                built = self.an.components(cls, node.attr)
                if isinstance(built, list):
                    found |= frozenset({("object", c) for c in built})
            where = cls.lookup(node.attr)
            if where[0] == "method":
                found |= frozenset({("bound", token, node.attr)})
        return found

    def value(self, node) -> frozenset:
        if node is None:
            return E
        if isinstance(node, ast.Name):
            if node.id in self.locals:
                return self.local(node.id)
            return frozenset({("global", self.module, node.id, tuple(self.imported.get(node.id, ())))})
        if isinstance(node, ast.Attribute):
            return self.attribute(node, self.value(node.value))
        if isinstance(node, ast.Call):
            return self.call(node)
        if isinstance(node, ast.Tuple) and not any(isinstance(e, ast.Starred) for e in node.elts):
            parts = tuple(self.value(e) for e in node.elts)
            return _capped(frozenset({("tuple", parts)}), _DEPTH) if any(parts) else E
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return _element(E.union(*(self.value(e) for e in node.elts)))
        if isinstance(node, ast.Dict):
            for key in node.keys:
                self.value(key)
            return _element(E.union(*(self.value(v) for v in node.values)))
        if isinstance(node, ast.Subscript):
            base = self.value(node.value)
            self.value(node.slice)
            if isinstance(node.slice, ast.Slice):
                return base
            if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int):
                return E.union(*(t[1][node.slice.value] if t[0] == "tuple" and -len(t[1]) <= node.slice.value < len(t[1])
                                 else self.items(frozenset({t})) for t in base))
            return self.items(base)
        if isinstance(node, ast.BoolOp):
            return E.union(*(self.value(v) for v in node.values))
        if isinstance(node, ast.IfExp):
            self.value(node.test)
            return self.value(node.body) | self.value(node.orelse)
        if isinstance(node, ast.NamedExpr):
            tokens = self.value(node.value)
            self.store(node.target, tokens)
            return tokens
        if isinstance(node, ast.Compare):
            if all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                self.identity.update(id(n) for n in [node.left, *node.comparators])
            operands = [self.value(node.left)] + [self.value(c) for c in node.comparators]
            if any(not isinstance(op, (ast.Is, ast.IsNot, ast.In, ast.NotIn)) for op in node.ops) and \
                    any(self.carries(t) for t in operands):
                self.gap(node, f"compares {self.said(E.union(*operands))} by value")
            return E
        if isinstance(node, ast.UnaryOp):
            self.value(node.operand)
            return E
        if isinstance(node, ast.BinOp):
            left, right = self.value(node.left), self.value(node.right)
            if isinstance(node.op, ast.Add) and all(t[0] in ("items", "tuple") for t in left | right):
                return _element(self.items(left | right))  # joined sequences hold both's items
            if self.carries(left | right):
                self.gap(node, f"computes with {self.said(left | right)}")
            return E
        if isinstance(node, ast.JoinedStr):
            for part in node.values:
                if isinstance(part, ast.FormattedValue) and self.carries(self.value(part.value)):
                    self.gap(node, f"formats {self.said(self.value(part.value))} as text")
            return E
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            for generator in node.generators:
                self.store(generator.target, self.items(self.value(generator.iter)))
                for condition in generator.ifs:
                    self.value(condition)
            if isinstance(node, ast.DictComp):
                self.value(node.key)
                return _element(self.value(node.value))
            return _element(self.value(node.elt))
        if isinstance(node, ast.Lambda):
            self.value(node.body)  # its body runs in this function's names, whenever it is called
            return E
        if isinstance(node, (ast.Await, ast.Yield, ast.YieldFrom, ast.Starred, ast.FormattedValue)):
            return self.value(node.value)
        if isinstance(node, ast.Slice):
            for part in (node.lower, node.upper, node.step):
                self.value(part)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            return frozenset({("name", node.value)})  # a name getattr may be given
        return E

    # -------------------------------------------------------------- calls
    def call(self, node: ast.Call) -> frozenset:
        if isinstance(node.func, ast.Name) and node.func.id in self.an.passing.get(id(self.node), ()):
            return E  # a wrapper's call of what it wraps: that call is followed where the wrapped one is called
        born = self.an.question.born(self, node)
        positional = [self.value(a.value if isinstance(a, ast.Starred) else a) for a in node.args]
        keywords = {k.arg: self.value(k.value) for k in node.keywords}
        if born is not None:
            self.value(node.func)
            return frozenset({born})
        given = E.union(*positional, *keywords.values())
        carried = self.carries(given)
        spread = any(isinstance(a, ast.Starred) for a in node.args) or None in keywords
        callees, why = self.callees(node.func)
        if callees is None:
            if carried:
                self.gap(node, f"passes {self.said(given)} to {ast.unparse(node.func)}, {why}")
            return E
        found = E
        for kind, what in callees:
            if kind == "builtin":
                found |= self.builtin(node, what, positional, keywords, carried)
            elif kind == "items":
                holder, method, tokens = what
                if method in ADDING and given:
                    self.add(holder, tokens, self.items(given) if method.startswith(("extend", "update")) else given, node)
                elif method in TAKING:
                    found |= tokens if method == "copy" else self.items(tokens)
            elif kind == "partial":
                inner, why = self.callees(node.args[0]) if node.args else (None, "nothing to bind")
                bound = E.union(*positional[1:], *keywords.values())
                if inner is None:
                    if self.carries(bound):
                        self.gap(node, f"binds {self.said(bound)} to {ast.unparse(node.args[0])}, {why}")
                    continue
                for inner_kind, inner_what in inner:
                    if inner_kind == "function":
                        self.bind(inner_what, positional[1:], keywords, node)
                    elif self.carries(bound):
                        self.gap(node, f"binds {self.said(bound)} to {ast.unparse(node.args[0])}")
            elif kind == "function":
                if spread and carried:
                    self.gap(node, f"passes {self.said(given)} to {ast.unparse(node.func)} through *args or **kwargs")
                    continue
                found |= self.bind(what, positional, keywords, node)
            elif kind == "class":
                found |= self.construct(node, what, positional, keywords, carried)
        return found

    def resolve_name(self, name: str) -> tuple:
        if name in self.imported:
            return self._imported(*self.imported[name])
        return self.an.sources.resolve(self.module, name)

    def resolved_globals(self, tokens: frozenset) -> frozenset:
        """Tokens with each global name (read lazily: most are never called nor looked into) resolved."""
        if not any(t[0] == "global" for t in tokens):
            return tokens
        found = set()
        for token in tokens:
            if token[0] != "global":
                found.add(token)
                continue
            _, module, name, imported = token
            if imported:
                what = self._imported(*imported)
            else:
                what = self.an.sources.resolve(module, name)
            found |= self.named(what)
        return frozenset(found)

    def _imported(self, source: str, attr: str) -> tuple:
        if source.split(".")[0] != "sglang":
            return ("outside", f"{source}.{attr}")
        if self.an.sources.has(f"{source}.{attr}"):
            return ("module", f"{source}.{attr}")
        return self.an.sources.resolve(source, attr)

    def named(self, what: tuple) -> frozenset:
        """A global name used as a value: a function or a class of the sources (a token to call
        later), else nothing followed."""
        if what[0] == "def":
            return frozenset({("def", (None, what[1], what[2]))})
        if what[0] == "class":
            return frozenset({("class", self.an.sources.cls(what[1], what[2]))})
        if what[0] == "literal":
            held = what[2].values if isinstance(what[2], ast.Dict) else what[2].elts
            return _element(E.union(*(self.named(self.an.sources.expression(what[1], v)) for v in held
                                      if isinstance(v, (ast.Name, ast.Attribute)))))
        return E

    def builtin(self, node, name: str, positional: list, keywords: dict, carried: bool) -> frozenset:
        if name in ITERATING:
            return self.items(E.union(*positional)) if name == "next" else _element(self.items(E.union(*positional)))
        if name in ("getattr", "setattr"):
            names = positional[1] if len(positional) >= 2 else E
            named = bool(names) and all(t[0] == "name" for t in names)
            if named and name == "getattr":
                found = positional[2] if len(positional) > 2 else E
                for _, attribute in sorted(names):
                    load = ast.Attribute(value=node.args[0], attr=attribute, ctx=ast.Load(), lineno=node.lineno)
                    found |= self.attribute(load, positional[0])
                return found
            if named and name == "setattr":
                if len(positional) == 3:
                    for _, attribute in sorted(names):
                        self.keep(node.args[0], positional[0], attribute, positional[2], node)
                return E
            if not named:
                if name == "setattr" and len(positional) == 3 and self.carries(positional[2]):
                    self.gap(node, f"setattr() keeps {self.said(positional[2])} under a name made at run time")
                if name == "getattr" and positional:  # any attribute it keeps, or a method of it
                    held = E.union(*(self.an.kept[t[1]] for t in positional[0] if t[0] in ("object", "built")))
                    if any(t[0] == "value" for t in positional[0]):
                        self.gap(node, f"getattr() on {self.said(positional[0])} by a name made at run time")
                    return held
                return E
        if name not in HARMLESS and carried:
            self.gap(node, f"passes {self.said(E.union(*positional, *keywords.values()))} to {name}()")
        return E

    def construct(self, node, cls: Class, positional: list, keywords: dict, carried: bool) -> frozenset:
        if not carried:
            return frozenset({("built", cls)})
        init = cls.lookup("__init__")
        if init[0] == "method":
            self.bind((cls, init[1].module, init[2]), positional, keywords, node)
        elif cls.field_bases():
            names = cls.all_fields()
            given = list(zip(names, positional)) + list(keywords.items())
            for name, tokens in given:
                self.keep(None, frozenset({("built", cls)}), name, tokens, node)
            after = cls.lookup("__post_init__")
            if after[0] == "method":
                self.bind((cls, after[1].module, after[2]), [], {}, node)
        else:
            self.gap(node, f"builds {cls} from {self.said(E.union(*positional, *keywords.values()))}, "
                           f"which runs code that is not followed")
        return frozenset({("built", cls)})

    def bind(self, target: tuple, positional: list, keywords: dict, node) -> frozenset:
        """A call of `target` (class context, module, def) with these tokens: its parameters take
        them, and what it returns comes back."""
        context, module, function = target
        wrappers, unplain = self.an.decorations(module, function)
        given = E.union(*positional, *keywords.values())
        if unplain and self.carries(given):
            self.gap(node, f"passes {self.said(given)} to {function.name}, decorated by {unplain[0]}, which is not "
                           f"shown to pass its arguments through")
        names = [p.arg for p in function.args.posonlyargs + function.args.args]
        static = "staticmethod" in _marks(function)
        if context is not None and not static and names:
            names = names[1:]
        taken = {}
        for index, tokens in enumerate(positional):
            if index < len(names):
                taken[names[index]] = tokens
            elif function.args.vararg is not None:
                taken[function.args.vararg.arg] = taken.get(function.args.vararg.arg, E) | _element(tokens)
            elif self.carries(tokens):
                self.gap(node, f"passes more arguments than {function.name} takes")
        known = set(names) | {p.arg for p in function.args.kwonlyargs}
        for name, tokens in keywords.items():
            if name in known:
                taken[name] = taken.get(name, E) | tokens
            elif function.args.kwarg is not None:
                taken[function.args.kwarg.arg] = taken.get(function.args.kwarg.arg, E) | _element(tokens)
            elif self.carries(tokens):
                self.gap(node, f"passes {name}= which {function.name} does not take")
        for wrapper_module, wrapper, passing in wrappers:  # each reads what it reads of `self`
            self.an.passing[id(wrapper)] = passing
            self.an.function(context, wrapper_module, wrapper)
        key = self.an.function(context, module, function)
        current = self.an.params[key]
        grew = False
        for name, tokens in taken.items():
            if tokens - current.get(name, E):
                current[name] = current.get(name, E) | tokens
                grew = True
        if grew:
            self.an.changed(("params", key))
            self.an.enqueue(key)
        self.uses(("returns", key))
        return self.an.returns[key]

    def callees(self, func) -> tuple:
        """([(kind, what)], "") for what a call of `func` runs, or (None, why it cannot be told):
        kinds "function" (context, module, def), "class", "builtin", "items" (a container's
        method), "partial"."""
        if isinstance(func, ast.Name):
            if func.id in self.locals:
                found = self.callable_tokens(self.local(func.id))
                return (found, "") if found else (None, f"{func.id} is a local whose callee is not known")
            return self.resolved(self.resolve_name(func.id))
        if not isinstance(func, ast.Attribute):
            return None, "the callee is computed"
        if _is_super(func.value) and self.context is not None:
            return self.after_owner(func.attr)
        receiver = self.resolved_globals(self.value(func.value))
        if receiver:
            found = []
            for token in receiver:
                if token[0] in ("object", "built", "value"):
                    where = token[1].lookup(func.attr)
                    if where[0] == "method":
                        found.append(self.method(token, func.attr))
                    elif where[0] == "attribute" or (where[0] == "none" and self.an.fields[(token[1], func.attr)]):
                        return None, f"{token[1].name}.{func.attr} is an attribute, called"
                    elif where[0] == "outside":
                        return None, f"{token[1].name}.{func.attr} may come from {where[1]}"
                    else:
                        return None, f"{token[1].name}.{func.attr} is not a method found in the sources"
                elif token[0] in ("items", "tuple"):
                    if func.attr not in ADDING | TAKING:
                        return None, f".{func.attr} of a container is not followed"
                    found.append(("items", (func.value, func.attr, receiver)))
                elif token[0] == "class":
                    where = token[1].lookup(func.attr)
                    if where[0] != "method":
                        return None, f"{token[1].name}.{func.attr} is not a method found in the sources"
                    found.append(("function", (token[1], where[1].module, where[2])))
                elif token[0] in ("bound", "def"):
                    return None, "an attribute of a function is not followed"
            if isinstance(func.value, ast.Attribute) and not found:
                return None, f"{ast.unparse(func.value)} is not followed"
            if found:
                return found, ""
        if isinstance(func.value, ast.Attribute) and self.self_chain(func.value):
            built = self.chain_classes(func.value)
            if built == "items":
                if func.attr in ADDING | TAKING:
                    return [("items", (func.value, func.attr, receiver))], ""
                return None, f".{func.attr} of a container is not followed"
            if isinstance(built, str):
                return None, built
            if all(c.lookup(func.attr)[0] == "method" for c in built):
                return [self.method(("object", c), func.attr) for c in built], ""
            return None, f"{ast.unparse(func.value)}.{func.attr} is not a method of {', '.join(map(str, built))}"
        if isinstance(func.value, ast.Name) and func.value.id in self.locals:
            return None, f"{func.value.id}'s class is not known"
        return self.resolved(self.an.sources.expression(self.module, func, name=self.resolve_name))

    def after_owner(self, name: str) -> tuple:
        """`super().name`: found in the context's MRO after the class defining this function."""
        order = self.context.mro()
        owner = next((i for i, c in enumerate(order) if isinstance(c, Class) and self.node in c.methods.values()), None)
        for cls in order[owner + 1:] if owner is not None else ():
            if not isinstance(cls, Class):
                return None, f"super().{name} may come from {cls}"
            if name in cls.methods:
                return [("function", (self.context, cls.module, cls.methods[name]))], ""
        return None, f"super().{name} is not found in the sources"

    def callable_tokens(self, tokens: frozenset) -> list:
        """What calling a value holding these tokens runs; empty where any is not known."""
        found = []
        for token in self.resolved_globals(tokens):
            if token[0] == "bound":
                found.append(self.method(token[1], token[2]))
            elif token[0] == "def":
                found.append(("function", token[1]))
            elif token[0] == "class":
                found.append(("class", token[1]))
            else:
                return []
        return found

    def self_chain(self, node) -> bool:
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, ast.Name) and node.id == self.self_name and self.self_name is not None

    def chain_classes(self, node: ast.Attribute):
        """The classes `self.a.b` is built as (a list), "items", or why not."""
        if isinstance(node.value, ast.Attribute):
            parents = self.chain_classes(node.value)
            if not isinstance(parents, list):
                return parents if isinstance(parents, str) and parents != "items" else f"{ast.unparse(node.value)} is a container"
        else:
            parents = [self.context]
        found = []
        for parent in parents:
            built = self.an.components(parent, node.attr)
            if not isinstance(built, list):
                return built if len(parents) == 1 or built != "items" else f"{ast.unparse(node)} is built differently"
            found += built
        return list(dict.fromkeys(found))

    def method(self, token: tuple, name: str) -> tuple:
        where = token[1].lookup(name)
        return ("function", (token[1], where[1].module, where[2]))

    def resolved(self, what: tuple) -> tuple:
        if what[0] == "def":
            return [("function", (None, what[1], what[2]))], ""
        if what[0] == "class":
            return [("class", self.an.sources.cls(what[1], what[2]))], ""
        if what[0] == "attribute":
            where = what[1].lookup(what[2])
            if where[0] == "method":
                return [("function", (what[1], where[1].module, where[2]))], ""
            return None, f"{what[1].name}.{what[2]} is not a method"
        if what[0] == "outside" and what[1] == "functools.partial":
            return [("partial", None)], ""
        if what[0] == "outside" and what[1] == "builtins.object.__setattr__":
            return [("builtin", "setattr")], ""
        if what[0] == "outside" and what[1].startswith("builtins."):
            return [("builtin", what[1].partition(".")[2])], ""
        if what[0] == "outside":
            return None, f"which is {what[1]}, outside the engine"
        return None, what[1]
