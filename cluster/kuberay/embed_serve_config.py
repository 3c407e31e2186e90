"""Copy serve_configs/prod.yaml, verbatim, into rayservice.yaml's spec.serveConfigV2 block.

    python cluster/kuberay/embed_serve_config.py          # rewrite the manifest
    python cluster/kuberay/embed_serve_config.py --check  # exit 1 if the manifest has drifted

The manifest and the serve config must never disagree: tests/unit/test_cluster_manifests.py fails when they do and
points here. Text-based on purpose, so the manifest's comments and layout survive.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVE_CONFIG = REPO / "serve_configs" / "prod.yaml"
MANIFEST = REPO / "cluster" / "kuberay" / "rayservice.yaml"
BLOCK_KEY = "  serveConfigV2: |"
BLOCK_INDENT = "    "


def embedded(serve_config_text: str) -> str:
    return "".join(BLOCK_INDENT + line if line.strip() else line for line in serve_config_text.splitlines(True))


def refreshed_manifest(manifest_text: str, serve_config_text: str) -> str:
    lines = manifest_text.splitlines(True)
    start = next(i for i, line in enumerate(lines) if line.rstrip("\n") == BLOCK_KEY)
    end = start + 1
    # the block runs until the first non-blank line indented less than the block
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith(BLOCK_INDENT)):
        end += 1
    return "".join(lines[: start + 1]) + embedded(serve_config_text) + "".join(lines[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    current = MANIFEST.read_text()
    wanted = refreshed_manifest(current, SERVE_CONFIG.read_text())
    if args.check:
        if current != wanted:
            print(f"{MANIFEST} differs from {SERVE_CONFIG}: run python cluster/kuberay/embed_serve_config.py")
            return 1
        return 0
    MANIFEST.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
