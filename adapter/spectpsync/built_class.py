"""The class the engine's workers build as their rank-0 broadcast, followed from where they
build it: the class that runs, whatever it is called and wherever it lives.

Each worker (DSparkWorkerV2, DFlashWorkerV2) builds one `self._tp_sync = X(group)` in its
`__init__`. `X` is followed through the engine's own sources the way Python resolves it:
a name imported from another module (`from m import A as X`, relative or absolute), an
alias assigned at module level (`X = A`), a re-export (`from .home import A` in the module
imported from), and a factory function whose one return builds the class (`def X(group):
return A(group)`), until a `class` statement. The spelling decides nothing: what is found
is then judged by running it (observation) and, installed, by the objects the workers'
modules really hold. Where the chain cannot be followed (a class made inside a function,
a computed name) it is refused naming the step, and where the workers build different
classes too.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from ..engine import syntax
from ..engine.contract import Contract, source_proof
from ..engine.source_engine import imported_from
from .engine_class import CLASS, MODULE

WORKERS = {"sglang.srt.speculative.dspark_components.dspark_worker_v2": "DSparkWorkerV2",
           "sglang.srt.speculative.dflash_worker_v2": "DFlashWorkerV2"}
_HOPS = 12  # a chain longer than this is not an ordinary refactor


@dataclass(frozen=True)
class Built:
    """The class the workers build: defined as `name` in `module`; `via` how the workers'
    construction reaches it, for reasons (empty: built by its own name from MODULE)."""
    module: str
    name: str
    via: tuple = ()

    def said(self) -> str:
        where = f"{self.module}.{self.name}"
        hops = [hop for hop in self.via if hop.rpartition(".")[2] != self.name]  # its own name says nothing more
        return where if not hops else f"{where} (reached through {' -> '.join(hops)})"


def _binding(contract: Contract, name: str) -> tuple:
    package = (getattr(contract.module, "__file__", "") or "").endswith("__init__.py")
    return _bound(contract, name, package)


@source_proof("spectpsync-binding")
def _bound(contract: Contract, name: str, package: bool) -> tuple:
    """How module-level `name` is bound in the module's source: ("class",), ("import", module,
    name), ("alias", expression), ("function", the callee of its one returned construction, or
    None), or ("unknown", why)."""
    found = []
    for node in syntax.parse(contract.source()).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            found.append(("class",))
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    found.append(("import", imported_from(node, contract.name if package else
                                                          contract.name.rpartition(".")[0]), alias.name))
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            found.append(("alias", ast.unparse(node.value)))
        elif isinstance(node, ast.FunctionDef) and node.name == name:
            returns = [s for s in ast.walk(node) if isinstance(s, ast.Return)]
            built = len(returns) == 1 and isinstance(returns[0].value, ast.Call)
            found.append(("function", ast.unparse(returns[0].value.func) if built else None))
    if len(found) != 1:
        return ("unknown", f"{name} is bound {len(found)} times at module level")
    return found[0]


def follow(contract: Contract, engine, expression: str, via: tuple = (), function: bool = False) -> Built:
    """The class `expression` (a name, or module.name) names in `contract`'s module, a
    factory function followed to the class it builds; with `function`, the module-level
    function it names."""
    for _ in range(_HOPS):
        head, _, rest = expression.partition(".")
        if rest:  # module.attr: an imported module's attribute
            kind = _binding(contract, head)
            if kind[0] != "import":
                raise contract.refuse(expression, f"is built through {head}, which the sources do not show to be a module")
            target = engine.module(f"{kind[1]}.{kind[2]}")
            if target is None:
                raise contract.refuse(expression, f"names {kind[1]}.{kind[2]}, which this engine does not have")
            contract, expression = Contract(contract.adapter, target), rest
            via += (f"{contract.name}.{rest}",)
            continue
        kind = _binding(contract, expression)
        if kind[0] == ("function" if function else "class"):
            return Built(contract.name, expression, via)
        if kind[0] == "import":
            target = engine.module(kind[1])
            if target is None:
                raise contract.refuse(expression, f"is imported from {kind[1]}, which this engine does not have")
            contract, expression = Contract(contract.adapter, target), kind[2]
            via += (f"{kind[1]}.{kind[2]}",)
        elif kind[0] == "alias" or kind[0] == "function" and kind[1]:
            via += (f"{contract.name}.{expression}" + ("()" if kind[0] == "function" else ""),)
            expression = kind[1]
        else:
            why = kind[1] if kind[0] == "unknown" else f"function {expression} does not return one construction"
            raise contract.refuse(expression, f"cannot be followed to the {'function' if function else 'class'} "
                                              f"that runs: {why}")
    raise contract.refuse(expression, f"is reached through more than {_HOPS} names: not followed further")


@source_proof("spectpsync-construction")
def construction(found: Contract, worker: str) -> tuple:
    """(the callee of the one `self._tp_sync = X(...)` in `worker.__init__`, the call's
    source) or ("", why there is not exactly one)."""
    tree = syntax.parse(found.source())
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == worker]
    init = [n for c in classes for n in c.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    everywhere = [n for n in ast.walk(tree) if assigns(n, "_tp_sync", "self")]
    inside = [n for f in init for n in ast.walk(f) if assigns(n, "_tp_sync", "self")]
    if len(init) != 1 or len(everywhere) != 1 or len(inside) != 1 or not isinstance(inside[0].value, ast.Call):
        return "", (f"{worker}.__init__ no longer builds its one self._tp_sync = {CLASS}(...) "
                    f"({len(everywhere)} assignment(s) of self._tp_sync in the module)")
    return ast.unparse(inside[0].value.func), ast.unparse(inside[0].value)


def assigns(node, attr: str, receiver: str) -> bool:
    """`node` is an assignment to `<receiver>.attr` (among its targets)."""
    targets = (node.targets if isinstance(node, ast.Assign) else
               [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
    return any(isinstance(t, ast.Attribute) and t.attr == attr and ast.unparse(t.value) == receiver
               for target in targets for t in ast.walk(target))


def built_class(contract: Contract, engine) -> Built:
    """The one class every worker of this release builds as its self._tp_sync (module
    docstring); Refused where it cannot be followed, or the workers build different ones."""
    found = {}
    for name, worker in WORKERS.items():
        module = engine.module(name)
        if module is None:
            continue
        here = Contract(contract.adapter, module)
        callee, text = construction(here, worker)
        if not callee:
            raise here.refuse(f"{worker}.__init__", text)
        found[worker] = follow(here, engine, callee, (f"{name}.{callee}",))  # the name the worker builds it by
    classes = {(b.module, b.name) for b in found.values()}
    if len(classes) > 1:
        said = "; ".join(f"{worker} builds {b.module}.{b.name}" for worker, b in found.items())
        raise contract.refuse(CLASS, f"the workers build different classes ({said}): each would need its own proof")
    if not found:
        return Built(MODULE, CLASS)
    return max(found.values(), key=lambda b: len(b.via))  # the longest chain says the most


def _engine(contract: Contract, engine):
    from ..engine.installed import InstalledEngine

    return engine or getattr(contract.module, "__engine__", None) or InstalledEngine()


def of(contract: Contract, engine=None) -> tuple[Built, Contract]:
    """(the class the workers build, a contract on its home module) in `engine` (default:
    the engine `contract`'s module belongs to)."""
    engine = _engine(contract, engine)
    built = built_class(contract, engine)
    home = contract if built.module == contract.name else Contract(contract.adapter, engine.module(built.module))
    return built, home


def defining(contract: Contract, attr: str, engine=None) -> tuple[Contract, str]:
    """(a contract on the module, the class's name) of the class in the built class's MRO
    that defines `attr`: what a patch of it must replace, and whose signature is checked."""
    engine = _engine(contract, engine)
    built, home = of(contract, engine)
    cls = home.attr(built.name)
    owner = next((c for c in cls.__mro__[:-1] if attr in vars(c)), cls)
    module = home.module if owner.__module__ == home.name else engine.module(owner.__module__)
    return (home if module is None else Contract(contract.adapter, module)), owner.__qualname__
