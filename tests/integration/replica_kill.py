"""Kill one replica actor of a Serve deployment (no restart of that actor: Serve must replace it), from a process of
its own that connects to the cluster first and kills when told. Connecting a driver took seconds to minutes on a
busy host and held the test process's interpreter meanwhile; a test under load wants the kill itself at a moment it
picks (while requests are in flight), not whenever the connection is ready.

    python -m tests.integration.replica_kill DEPLOYMENT (--only | --one-of-several)

prints `{"ready": [NAME, ...]}` once connected (the deployment's replica actors, by name), waits for a line on stdin
naming the one to kill (an empty line: the first), kills it, and prints its name and the kill's moments on the
host's monotonic clock (which every process of the host shares): `sent_at` just before `ray.kill` and `killed_at`
when it returned. Stdin closing without a line leaves the replicas alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("deployment")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--only", action="store_true", help="the deployment has exactly one replica")
    which.add_argument("--one-of-several", action="store_true", help="the first by name of two or more")
    args = parser.parse_args()

    import ray

    ray.init(address="auto", logging_level="ERROR")
    try:
        # SERVE_REPLICA::<app>#<deployment>#<replica id>
        actors = sorted((a for a in ray.util.list_named_actors(all_namespaces=True)
                         if f"#{args.deployment}#" in a["name"]), key=lambda a: a["name"])
        if args.only:
            assert len(actors) == 1, actors
        else:
            assert len(actors) >= 2, actors
        # Handles first: getting one took minutes on a busy host, the kill itself milliseconds.
        handles = {a["name"]: ray.get_actor(a["name"], namespace=a["namespace"]) for a in actors}
        print(json.dumps({"ready": list(handles)}), flush=True)
        line = sys.stdin.readline()
        if not line:
            ray.shutdown()
            return
        name = line.strip() if line.strip() in handles else actors[0]["name"]
        victim = handles[name]
        sent_at = time.monotonic()
        ray.kill(victim, no_restart=True)
        killed_at = time.monotonic()
        # Dead for sure before this driver goes (the kill is a request to Ray's control plane).
        while True:
            try:
                ray.get(victim.__ray_ready__.remote(), timeout=60)
            except ray.exceptions.RayActorError:
                break
            time.sleep(0.1)
        print(json.dumps({"name": name, "sent_at": sent_at, "killed_at": killed_at}), flush=True)
    except BaseException:
        ray.shutdown()
        raise
    # Gone without ray.shutdown(), which took over two minutes on a busy host after a kill: this driver owns nothing
    # in the cluster (Serve's actors are detached), so the cluster only notes that a driver left.
    os._exit(0)


if __name__ == "__main__":
    main()
