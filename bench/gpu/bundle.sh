#!/usr/bin/env bash
# Prepare, on this (CPU) machine, what the lent H200 needs to run tests/test_fence_gpu.py and
# bench/fence_cost.py against the real engine: it has Python 3.12 and torch but no registry.
#   bash bench/gpu/bundle.sh [DEST]     (DEST: default the repository root)
#   DEST/.gpu/   sglang 0.5.23's .py sources (from .venv) as a tarball, this folder's scripts and stubs;
#                sglang 0.5.18's .py sources (from .engines) and, in whl18/, its pinned transformers,
#                tokenizers, xgrammar and huggingface_hub (tests/test_tp_nccl.py), about 22 MiB more
#   DEST/.whl/   the engine's pure-Python and cp312 dependencies, pinned, as wheels
#   DEST/.dist/  the pack's wheel, built as the image's builder stage builds it
# Keep DEST's copies out of git (.git/info/exclude) and carry them. The device tool sends the main
# checkout only: from a worktree, copy its files into an ignored folder of the main checkout and
# bundle into that folder (about 50 MiB):
#   git archive HEAD | tar -x -C /work/main/.wt13 && bash bench/gpu/bundle.sh /work/main/.wt13
#   run(command="cd .wt13 && bash bench/gpu/run.sh", carry=[".wt13"])
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=$(realpath "${1:-.}")
if [ "$DEST" = "$PWD" ]; then
  exclude=$(git rev-parse --git-path info/exclude)
  for p in /.gpu/ /.whl/ /.dist/; do grep -qx "$p" "$exclude" || echo "$p" >> "$exclude"; done
fi
rm -rf "$DEST/.gpu" "$DEST/.dist" && mkdir -p "$DEST/.gpu" "$DEST/.whl" "$DEST/.dist"
cp -r bench/gpu/setup.sh bench/gpu/run.sh bench/gpu/resolved_window.sh bench/gpu/stubs "$DEST/.gpu/"
site=$(.venv/bin/python -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("sglang").origin).parent.parent)')
# tar's status 1 is "a file changed as we read it": a hard link made to an engine file meanwhile (the tests'
# next-release trees) changes its ctime, not its content. The kernel sources the pack reads go too (an installed
# engine ships them; known_bad_config reads the plan kernel's write pad): source_engine.KERNEL_SOURCES, one list
readarray -t kernels < <(.venv/bin/python -c 'from sglang_dsv41_adapters.engine.source_engine import KERNEL_SOURCES
for path in KERNEL_SOURCES: print(f"-o\n-path\n*{path}")')
sources() { find sglang \( -name '*.py' "${kernels[@]}" \) -print0 |
  { tar --null -T - --warning=no-file-changed -cJf - || [ $? -eq 1 ]; }; }
(cd "$site" && sources) > "$DEST/.gpu/sglang-src.tar.xz"
(cd .engines/sglang-0.5.18 && sources) > "$DEST/.gpu/sglang18-src.tar.xz"
# sglang 0.5.17's .py sources (its ServerArgs resolution, bench/gpu/resolved_window.sh), with 0.5.18's pins
(cd .engines/src/0.5.17 && sources) > "$DEST/.gpu/sglang17-src.tar.xz"
.venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$DEST/.whl" \
  annotated_types==0.8.0 apache_tvm_ffi==0.1.15.post2 asttokens==3.0.2 compressed_tensors==0.20.1 decorator==5.3.1 \
  dill==0.4.1 distro==1.9.0 executing==2.3.0 fastapi==0.165.0 gguf==0.19.0 \
  ipython==9.18.1 ipython_pygments_lexers==1.1.1 jedi==0.20.1 jiter==0.19.0 loguru==0.7.3 \
  matplotlib_inline==0.2.2 msgspec==0.23.0 openai==2.8.0 opentelemetry_api==1.45.2 orjson==3.13.0 \
  parso==0.8.7 partial_json_parser==0.2.1.1.post7 pexpect==4.9.0 prompt_toolkit==3.0.53 ptyprocess==0.7.0 \
  pure_eval==0.2.4 pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5 pyzmq==27.3.0 \
  setproctitle==1.3.8 sniffio==1.3.1 stack_data==0.6.3 starlette==1.10.0 traitlets==5.16.1 \
  truststore==0.10.5 typing_inspection==0.4.5 uvicorn==0.54.0 wcwidth==0.9.4
# 0.5.18's own pins (.engines/deps-0.5.18), installed apart (/tmp/site18) ahead of the device's: later
# transformers already hold 0.5.18's qwen3_asr config and refuse its registration (5.19 here; the device
# has 5.17), tokenizers 0.23.2 there is above transformers 5.12.1's range, xgrammar is not there, and
# huggingface_hub (1.33.0 there too) is pinned with them so that no other version can slip in.
.venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST/.gpu/whl18" transformers==5.12.1 tokenizers==0.22.2 xgrammar==0.2.9 huggingface_hub==1.33.0
# The pack's wheel from a copy of what the Dockerfile's builder stage copies (no build/ left here).
src=$(mktemp -d) && cp -r pyproject.toml entrypoint.py README.md adapter "$src/"
.venv/bin/python -m pip wheel --quiet --no-deps "$src" -w "$DEST/.dist" && rm -rf "$src"
du -sh "$DEST/.gpu" "$DEST/.whl" "$DEST/.dist"
