"""Engine trees with the DeepSeek-V4 compress write pad added or taken out (drift tests of
known_bad_config): the release's own files, hard-linked, with upstream's fix
(sgl-project/sglang#34189) applied or reverted in the shape the releases carry it.

- `added`: 0.5.17's tree with the fix as 0.5.18 carries it: get_compress_state_write_pad in
  the memory pool, the pool configurator bounding the draft count with it, and, where the
  tree holds the plan kernel's source, its pad derived from the ring;
- `removed`: a tree of 0.5.18+ with those three taken out again (the kernel's pad capped at
  kMaxMTPDraftTokens = 4, as up to 0.5.17).

The label stays the release's: the verdict must follow the code, not the label.
"""

from __future__ import annotations

import ast
import pathlib
import zipfile

from .engines import linked_copy
from .next_release import edit

POOL = "srt/mem_cache/deepseek_v4_memory_pool.py"
CONFIGURATOR = "srt/model_executor/pool_configurator.py"
KERNEL = "kernels/jit/csrc/deepseek_v4/c_plan.cuh"

PAD_FUNCTION = '''def get_compress_state_write_pad(compress_ratio: int, ring_size: int) -> int:
    """Largest draft-token count this ring can serve; mirrors `mtp_pad` in
    `c_plan.cuh`, where the bound is derived."""
    window_size = compress_ratio * (2 if compress_ratio == 4 else 1)
    return ring_size - window_size + 2 if ring_size > window_size else 0


'''
BOUND_CALL_0518 = '''
        if self.is_speculative:
            # Ring is sized once here, so it must serve the largest adaptive tier.
            self._assert_ring_serves_draft_tokens(
                kvc.server_args.max_speculative_num_draft_tokens or 0
            )
'''
BOUND_METHOD_0518 = '''    def _assert_ring_serves_draft_tokens(self, num_draft_tokens: int) -> None:
        """A verify batch writes its whole optimistic tail into the ring, so ring
        capacity bounds the draft count."""
        for compress_ratio, ring_size, num_layers in (
            (4, self.c4_ring_size, self.num_layers_ca4),
            (128, self.c128_ring_size, self.num_layers_ca128),
        ):
            if num_layers == 0:
                continue
            max_draft_tokens = get_compress_state_write_pad(compress_ratio, ring_size)
            assert num_draft_tokens <= max_draft_tokens, (
                f"speculative_num_draft_tokens={num_draft_tokens} exceeds what the c{compress_ratio} "
                f"compress state ring can keep resident (ring_size={ring_size} serves at most "
                f"{max_draft_tokens} draft tokens)."
            )

'''
CAPPED = ("  constexpr int32_t kMaxMTPDraftTokens = 4;\n"
          "  const auto mtp_pad = std::min(ring_size - compress_ratio, kMaxMTPDraftTokens);\n")
DERIVED = "  const auto mtp_pad = ring_size > window_size ? ring_size - window_size + 2 : 0;\n"


def copy_tree(tree: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    """`tree`'s sglang/ and dist-info, linked into `into` (engines.linked_copy; an edit writes a file of its own)."""
    for entry in tree.iterdir():
        if entry.name == "sglang" or (entry.name.startswith("sglang-") and entry.name.endswith(".dist-info")):
            linked_copy(entry, into / entry.name)
    return into


def release_kernel(wheel: pathlib.Path, into: pathlib.Path) -> None:
    """The release wheel's plan kernel source, placed in the tree `into` (a tree unpacked for
    the compatibility matrix holds only the Python sources)."""
    with zipfile.ZipFile(wheel) as archive:
        text = archive.read(f"sglang/{KERNEL}")
    target = into / "sglang" / KERNEL
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(text)


def added(tree: pathlib.Path, into: pathlib.Path, kernel: bool = True) -> pathlib.Path:
    """A copy of 0.5.17's `tree` carrying the derived write pad (`kernel`: its plan kernel's
    source too, where the tree holds it)."""
    root = copy_tree(tree, into)
    edit(root, POOL, ("\n\nclass DeepSeekV4SingleKVPool(KVCache):\n", "\n\n" + PAD_FUNCTION + "class DeepSeekV4SingleKVPool(KVCache):\n"))
    edit(root, CONFIGURATOR,
         ("from sglang.srt.mem_cache.deepseek_v4_memory_pool import get_compress_state_ring_size\n",
          "from sglang.srt.mem_cache.deepseek_v4_memory_pool import (\n    get_compress_state_ring_size,\n"
          "    get_compress_state_write_pad,\n)\n"),
         ("        self.num_layers_ca128 = sum(1 for r in self.compression_ratios if r == 128)\n",
          "        self.num_layers_ca128 = sum(1 for r in self.compression_ratios if r == 128)\n" + BOUND_CALL_0518),
         ("    def _get_bytes_per_full_token(self) -> float:\n",
          BOUND_METHOD_0518 + "    def _get_bytes_per_full_token(self) -> float:\n"))
    if kernel and (root / "sglang" / KERNEL).is_file():
        edit(root, KERNEL, (CAPPED, DERIVED))
    return root


def removed(tree: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    """A copy of `tree` (0.5.18+) without the derived write pad: the function, the pool
    configurator's bound and, where the tree holds it, the kernel's derived pad."""
    root = copy_tree(tree, into)
    edit(root, POOL, (definition(root / "sglang" / POOL, "get_compress_state_write_pad"), ""))
    configurator = (root / "sglang" / CONFIGURATOR).read_text(encoding="utf-8")
    call = configurator.index("        if self.is_speculative:\n            # Ring is sized once here")
    edit(root, CONFIGURATOR, ("    get_compress_state_write_pad,\n", ""),
         (definition(root / "sglang" / CONFIGURATOR, "_assert_ring_serves_draft_tokens"), ""),
         (configurator[call:configurator.index("\n\n", call) + 2], ""))
    if (root / "sglang" / KERNEL).is_file():
        edit(root, KERNEL, (DERIVED, CAPPED))
    return root


def definition(path: pathlib.Path, name: str) -> str:
    """The text of the one function or method `name` defined in `path`, with the blank lines after it."""
    text = path.read_text(encoding="utf-8")
    (node,) = [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.name == name]
    lines = text.splitlines(keepends=True)
    end = node.end_lineno
    while end < len(lines) and not lines[end].strip():
        end += 1
    return "".join(lines[node.lineno - 1:end])


RENAMED = "compress_ring_write_bound"
HOME = "srt/mem_cache/compress_ring.py"


def renamed(tree: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    """A copy of `tree` (0.5.18+) whose pad function has another name, in the pool and where
    the configurator imports and calls it: the same code."""
    root = copy_tree(tree, into)
    for relative in (POOL, CONFIGURATOR):
        text = (root / "sglang" / relative).read_text(encoding="utf-8")
        edit(root, relative, *[(line, line.replace("get_compress_state_write_pad", RENAMED))
                               for line in dict.fromkeys(l for l in text.splitlines(keepends=True)
                                                         if "get_compress_state_write_pad" in l)])
    return root


def moved(tree: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    """A copy of `tree` (0.5.18+) whose pad function moved to another module under another
    name, the pool importing it back under its old name (the configurator still imports it
    from the pool): the same code."""
    root = copy_tree(tree, into)
    function = definition(root / "sglang" / POOL, "get_compress_state_write_pad")
    (root / "sglang" / HOME).write_text('"""The compress-state ring\'s sizes."""\n\n\n'
                                        + function.replace("get_compress_state_write_pad", RENAMED), encoding="utf-8")
    edit(root, POOL, (function, ""),
         ("\n\nclass DeepSeekV4SingleKVPool(KVCache):\n",
          f"\n\nfrom sglang.srt.mem_cache.compress_ring import {RENAMED} as get_compress_state_write_pad  # noqa: E402\n\n\n"
          "class DeepSeekV4SingleKVPool(KVCache):\n"))
    return root


def without_kernel(tree: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    """A copy of `tree` without the plan kernel's source (a tree of Python sources only)."""
    root = copy_tree(tree, into)
    (root / "sglang" / KERNEL).unlink(missing_ok=True)
    return root
