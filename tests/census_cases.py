"""Ordinary refactors of the real engine modules that the census must refuse (each moves a
hazard's name where a drift check that looks for the call alone would miss it).

Each `Refactor` changes one module of a release (replacements in the real source, code
appended to it, a new module, or a module renamed) and names the text on the line the
refusal must point at. `imported(release)` judges them on the installed engine through
DoctoredEngine (run in a child interpreter for 0.5.18); `source_tree` writes the same
change into a copy of the release's sources, for `entrypoint.py doctor --engine`.

    python -m tests.census_cases RELEASE    # prints RESULT:{case: outcome} for the imported engine
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil
import sys
import tempfile
from dataclasses import dataclass
from typing import Optional

from harness.engines import linked_copy

SPEC = "sglang.srt.speculative"
PACKAGE = f"{SPEC}.dspark_components"
VERIFY = f"{PACKAGE}.dspark_verify"
WORKER = f"{PACKAGE}.dspark_worker_v2"
OBSERVABILITY = f"{PACKAGE}.dspark_observability"
SAMPLER = f"{PACKAGE}.dspark_draft_sampler"
FENCE, BROADCAST, MEMORY = "folded_fence", "rank0_broadcast", "group_min_memory"


@dataclass(frozen=True)
class Refactor:
    adapter: str
    module: str  # the module changed, added, or the new name of a renamed one
    marker: str  # text on the line the refusal must name
    replacements: tuple = ()
    tail: str = ""
    new: Optional[str] = None  # the source of a module that did not exist
    renamed_from: Optional[str] = None


FENCE_CASES = {
    "fence_alias": Refactor(FENCE, OBSERVABILITY, "read = epilogue.read_accept", tail=(
        "\n\ndef latest_accept(epilogue, bs):\n    read = epilogue.read_accept\n    return read(bs)\n")),
    "fence_partial": Refactor(FENCE, OBSERVABILITY, "functools.partial(epilogue.read_accept", tail=(
        "\n\nimport functools\n\n\ndef accept_later(epilogue, bs):\n"
        "    return functools.partial(epilogue.read_accept, bs)\n")),
    "fence_getattr": Refactor(FENCE, OBSERVABILITY, 'getattr(epilogue, "read_accept")', tail=(
        '\n\ndef accept_by_name(epilogue, bs):\n    return getattr(epilogue, "read_accept")(bs)\n')),
    "fence_new_module_spaced_call": Refactor(FENCE, f"{PACKAGE}.dspark_accept_relay", "epilogue.read_accept (bs)", new=(
        '"""Hands the folded accept to the scheduler."""\n\n\n'
        "def relay_accept(epilogue, bs):\n    return epilogue.read_accept (bs)\n")),
    "fence_buffer_view_method": Refactor(FENCE, WORKER, "return self.epilogue.bonus_buf[:bs]", tail=(
        "\n\nclass BonusView:\n    def __init__(self, epilogue):\n        self.epilogue = epilogue\n\n"
        "    def bonus(self, bs):\n        return self.epilogue.bonus_buf[:bs]\n")),
}

BROADCAST_CASES = {
    "broadcast_worker_imports_accept": Refactor(BROADCAST, WORKER, "import accept_draft_tokens", tail=(
        f"\n\nfrom {VERIFY} import accept_draft_tokens\n\n\nclass Reaccept:\n"
        "    def again(self, **kwargs):\n        return accept_draft_tokens(**kwargs)\n")),
    "broadcast_worker_imports_draft": Refactor(BROADCAST, WORKER, "import sample_draft_block as draft_again", tail=(
        f"\n\nfrom {PACKAGE}.dspark_draft import sample_draft_block as draft_again\n\n\nclass Redraft:\n"
        "    def again(self, **kwargs):\n        return draft_again(**kwargs)\n")),
    "broadcast_module_level_alias": Refactor(BROADCAST, WORKER, "_accept = _verify.accept_draft_tokens", tail=(
        f"\n\nfrom {PACKAGE} import dspark_verify as _verify\n\n_accept = _verify.accept_draft_tokens\n\n\n"
        "class Reaccept:\n    def again(self, **kwargs):\n        return _accept(**kwargs)\n")),
}

MEMORY_CASES = {
    "memory_probe_through_module_attribute": Refactor(
        MEMORY, WORKER, "common.get_available_gpu_memory(self.device", replacements=(
            ("from sglang.srt.utils import get_available_gpu_memory, is_cuda, is_npu",
             "from sglang.srt.utils import common, is_cuda, is_npu"),
            ("available_mem = get_available_gpu_memory(self.device, self.gpu_id)",
             "available_mem = common.get_available_gpu_memory(self.device, self.gpu_id)"))),
    "memory_probe_in_new_module": Refactor(MEMORY, f"{PACKAGE}.dspark_memory", "import get_available_gpu_memory", new=(
        "from sglang.srt.utils.common import get_available_gpu_memory\n\n\n"
        "def capture_budget_gb(device, gpu_id):\n    return get_available_gpu_memory(device, gpu_id)\n")),
    "memory_sampler_module_renamed": Refactor(MEMORY, f"{PACKAGE}.dspark_folded_sampler",
                                              "import get_available_gpu_memory", renamed_from=SAMPLER),
}

CASES = {"0.5.23": FENCE_CASES, "0.5.18": {**FENCE_CASES, **BROADCAST_CASES, **MEMORY_CASES}}


def real_source(module: str) -> str:
    return pathlib.Path(importlib.util.find_spec(module).origin).read_text(encoding="utf-8")


def changed_source(refactor: Refactor, original: str) -> str:
    if refactor.new is not None:
        return refactor.new
    text = original
    for old, new in refactor.replacements:
        assert text.count(old) == 1, f"{refactor.module}: {old!r} is not in the real source exactly once"
        text = text.replace(old, new)
    return text + refactor.tail


def marked_line(text: str, marker: str) -> int:
    lines = [n for n, line in enumerate(text.splitlines(), 1) if marker in line]
    assert len(lines) == 1, f"{marker!r} is on lines {lines}"
    return lines[0]


def _doctored_engine(refactor: Refactor, directory: str):
    from harness.doctored import DoctoredEngine, doctored_module, new_module_file

    if refactor.renamed_from is not None:
        text = real_source(refactor.renamed_from)
        return DoctoredEngine({refactor.renamed_from: None},
                              {refactor.module: new_module_file(refactor.module, text, directory)}), text
    if refactor.new is not None:
        return DoctoredEngine({}, {refactor.module: new_module_file(refactor.module, refactor.new, directory)}), refactor.new
    module = doctored_module(refactor.module, *refactor.replacements, tail=refactor.tail, directory=directory)
    return DoctoredEngine({refactor.module: module}), pathlib.Path(module.__file__).read_text(encoding="utf-8")


def imported(release: str) -> dict:
    """Each case's engine check on the installed engine with that one refactor."""
    from sglang_dsv41_adapters import load
    from sglang_dsv41_adapters.framework import runtime

    results = {}
    for case, refactor in CASES[release].items():
        directory = tempfile.mkdtemp()
        engine, text = _doctored_engine(refactor, directory)
        path = engine.files()[refactor.module]
        state, reason = runtime.engine_check(load(refactor.adapter), engine)
        results[case] = {"state": state, "reason": reason, "engine": engine.version,
                         "where": f"{path}:{marked_line(text, refactor.marker)}"}
        shutil.rmtree(directory, ignore_errors=True)
    return results


def source_tree(release_root: pathlib.Path, refactor: Refactor, into: pathlib.Path) -> str:
    """A copy of a release's sources (hard links, harness.engines.linked_copy: doctor --engine
    reads regular files only, never symbolic links) with the refactor written in; returns
    "path:line" of the marked line."""
    linked_copy(release_root, into)

    def path_of(module: str) -> pathlib.Path:
        return into.joinpath(*module.split(".")).with_suffix(".py")

    if refactor.renamed_from is not None:
        text = path_of(refactor.renamed_from).read_text(encoding="utf-8")
        path_of(refactor.renamed_from).unlink()
    elif refactor.new is not None:
        text = refactor.new
    else:
        text = changed_source(refactor, path_of(refactor.module).read_text(encoding="utf-8"))
    target = path_of(refactor.module)
    if target.exists():
        target.unlink()  # a hard link: never write through it into the release's own file
    target.write_text(text, encoding="utf-8")
    return f"{target}:{marked_line(text, refactor.marker)}"


if __name__ == "__main__":
    print("RESULT:" + json.dumps(imported(sys.argv[1])), flush=True)
