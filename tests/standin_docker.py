"""A stand-in for the `docker` command line, for the recipe's run.sh (tests/test_recipe.py).

Every call is recorded (one JSON array of its arguments per line in $STANDIN_DOCKER_DIR/calls);
containers and images live in $STANDIN_DOCKER_DIR/state.json. What the test sets:
  STANDIN_IMAGES          image=pack-version,... (an empty version: an image without the pack)
  STANDIN_DOCTOR_STATUS   what `docker run --rm IMAGE doctor --strict` exits with (default 0)
  STANDIN_EXIT_AFTER      N:STATUS: the new container exits with STATUS after N inspections and,
                          its restart policy being `always`, is restarting
  STANDIN_RUNNING         a container of this name is running before run.sh starts
"""

import json
import os
import sys

HOME = os.environ["STANDIN_DOCKER_DIR"]
STATE = os.path.join(HOME, "state.json")


def load():
    if os.path.exists(STATE):
        with open(STATE) as f:
            return json.load(f)
    images = dict(item.split("=", 1) for item in os.environ.get("STANDIN_IMAGES", "").split(",") if item)
    running = os.environ.get("STANDIN_RUNNING")
    containers = {running: {"status": "running", "code": 0, "restarts": 0, "inspected": 0}} if running else {}
    return {"images": images, "containers": containers}


def main(argv):
    with open(os.path.join(HOME, "calls"), "a") as f:
        f.write(json.dumps(argv) + "\n")
    state = load()
    images, containers = state["images"], state["containers"]
    status = 0
    if argv[:2] == ["image", "inspect"]:
        image = argv[-1]
        if image not in images:
            print(f"Error: No such image: {image}", file=sys.stderr)
            status = 1
        elif "--format" in argv:
            print(images[image] or "<no value>")
    elif argv[0] == "pull":
        status = 1  # nothing to pull from here
    elif argv[0] == "run" and "--rm" in argv:
        status = int(os.environ.get("STANDIN_DOCTOR_STATUS", "0"))
        print(f"doctor --strict: exit {status}", file=sys.stderr)
    elif argv[0] == "run":
        name = argv[argv.index("--name") + 1]
        if name in containers:
            print(f"Conflict: the container name {name} is already in use", file=sys.stderr)
            status = 125
        else:
            containers[name] = {"status": "running", "code": 0, "restarts": 0, "inspected": 0}
            print("0123456789ab")
    elif argv[:2] == ["container", "inspect"]:
        status = 0 if argv[-1] in containers else 1
    elif argv[0] == "inspect":
        box = containers.get(argv[-1])
        if box is None:
            status = 1
        else:
            box["inspected"] += 1
            after = os.environ.get("STANDIN_EXIT_AFTER")
            if after and box["inspected"] > int(after.split(":")[0]) and box["restarts"] == 0:
                box.update(status="restarting", code=int(after.split(":")[1]), restarts=1)
            print(box["status"], box["code"], box["restarts"])
    elif argv[0] == "stop":
        box = containers.get(argv[-1])
        if box is None:
            status = 1
        else:
            box["status"] = "exited"
    elif argv[0] == "rm":
        status = 0 if containers.pop(argv[-1], None) else 1
    elif argv[0] == "logs":
        print("[sglang-adapters] pid=7 rank=launcher the engine must not start: ...")
    elif argv[0] == "update":
        status = 0 if argv[-1] in containers else 1
    else:
        print(f"standin docker: {argv[0]} is not simulated", file=sys.stderr)
        status = 2
    with open(STATE, "w") as f:
        json.dump(state, f)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
