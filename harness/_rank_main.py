"""Child side of harness.ranks.run_ranks: join the gloo group, run the target, print its result."""

import importlib
import json
import os
import sys

import torch.distributed as dist

from harness.ranks import RESULT


def main() -> None:
    target, kwargs = sys.argv[1], json.loads(sys.argv[2])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    module_name, func_name = target.split(":")
    result = getattr(importlib.import_module(module_name), func_name)(rank, world_size, **kwargs)
    print(RESULT + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
