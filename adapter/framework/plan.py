"""What an adapter's check decides: the patches it would make and the variables it hands
to the engine (a Plan), nothing done yet; the runtime carries it out (framework.patching)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..engine.contract import Contract, Refused


@dataclass(frozen=True)
class Patch:
    """One attribute an adapter replaces: `owner.name` wrapped by `wrapper` (wrapt style),
    or, with `proxy`, replaced by `proxy(original)` (a wrapt.ObjectProxy subclass)."""

    owner: object
    name: str
    wrapper: Optional[Callable] = None
    proxy: Optional[type] = None

    @property
    def where(self) -> str:
        return f"{getattr(self.owner, '__name__', str(self.owner)).rpartition('.')[2]}.{self.name}"


@dataclass
class Plan:
    """What an adapter would do to one engine, decided by its `check`; nothing done yet.

    state: "applied" or "superseded" for a whole adapter ("not needed" for one module);
    detail: the whole reason, every proof and site; short_reason: the deciding reason in
    a few words (doctor's one line per adapter), which an applied or superseded plan must
    give; env: variables handed to the engine's own switches (the runtime sets them)."""

    state: str
    detail: str
    patches: list[Patch] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    short_reason: str = field(default="", kw_only=True)


@dataclass(frozen=True)
class Hook:
    """One binding an adapter wraps, declared: the checks and the patch derive from it.

    binding: "name" or "Class.attr" in `module`; params: the parameters the wrapper relies
    on (name -> kind); used_in: the functions where the bound name may be used in its
    module (a use anywhere else is a path the wrapper does not see); tag: what the hook
    serves (the rank-0 broadcast's sites)."""

    module: str
    binding: str
    wrapper: Optional[Callable] = None
    params: dict = field(default_factory=dict)
    used_in: tuple[str, ...] = ()
    proxy: Optional[type] = None
    tag: frozenset = frozenset()




def check_hook(contract: Contract, hook: Hook) -> Patch:
    """Check one declared hook and return its patch."""
    owner_path, _, attr = hook.binding.rpartition(".")
    if hook.params:
        contract.params(hook.binding, hook.params)
    else:
        contract.attr(hook.binding)
    if hook.used_in:
        contract.only_used_in(attr, hook.used_in)
    owner = contract.attr(owner_path) if owner_path else contract.module
    return Patch(owner, attr, hook.wrapper, hook.proxy)





def combine(adapter: str, version: str, plans: Iterable[Plan]) -> Plan:
    """One adapter's plan from its per-module plans. A module's "not needed" never makes
    the adapter applied on its own: something must be patched or already fixed upstream."""
    done = [p for p in plans if p.state in ("applied", "superseded")]
    if not done:
        raise Refused(adapter, "<engine>", "found nothing to patch and no upstream fix", version)
    state = "applied" if any(p.state == "applied" for p in done) else "superseded"
    env: dict[str, str] = {}
    for plan in done:
        env.update(plan.env)
    return Plan(state, "; ".join(p.detail for p in done), [x for p in done for x in p.patches], env,
                short_reason="; ".join(p.short_reason for p in done if p.short_reason))
