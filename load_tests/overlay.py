"""Experiment configs as overlays on a shipped serve config, and `--set dotted.key=value` on any config.

An overlay (load_tests/configs/*.yaml) names a base config and holds only what differs from it:

    base: serve_configs/gpu-single.yaml     # a path from the repository root (or from the overlay's folder)
    unset:                                  # keys of the base removed first (dotted; a key that is absent is an error)
      - args.admission.realtime_reserved_hot_replicas
    args:                                   # deep-merged into the llm-lanes application's args
      hot_lane: {deployment: {num_replicas: 1}}
    runtime_env: {...}                      # deep-merged into that application's runtime_env
    http_options: {...}                     # any other key: deep-merged into the serve config's top level

Merging: mappings merge key by key, recursively; a list or a scalar in the overlay replaces the base's value whole.
A base may itself be an overlay.

`--set KEY=VALUE` changes one value after the merge (a sweep is one overlay run with several values, not one file
per value). KEY is dotted: `args.` and `runtime_env.` address the llm-lanes application (the one whose import_path is
app.main:build_app), any other first part the serve config's top level. VALUE is YAML (`4096`, `null`, `true`,
`[1, 2]`, `{}`); where the key already holds a string (an environment variable, say) a number stays a string, so
`--set args.cold_lane.deployment.env_vars.CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=75` gives "75".

Pure Python + PyYAML, so the GPU host's payload can merge configs too:

    python -m load_tests.overlay load_tests/configs/gpu-lanes-mps.yaml --set args.router.num_replicas=1 --out x.yaml
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml

REPO = Path(__file__).resolve().parents[1]
APP_IMPORT_PATH = "app.main:build_app"
# Overlay keys that go into the llm-lanes application rather than the serve config's top level.
APPLICATION_KEYS = ("args", "runtime_env")
OVERLAY_KEYS = ("base", "unset")


class OverlayError(ValueError):
    """A config that cannot be merged, or a --set that cannot be applied; the message names the file or key."""


def deep_merge(base: Any, override: Any) -> Any:
    """A new value: `override` merged into `base`. Mappings merge key by key; anything else in `override` (a list, a
    scalar, null) replaces the base's value whole. Neither argument is changed."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = {key: copy.deepcopy(value) for key, value in base.items()}
        for key, value in override.items():
            merged[key] = deep_merge(base[key], value) if key in base else copy.deepcopy(value)
        return merged
    return copy.deepcopy(override)


def llm_lanes_application(serve_config: dict[str, Any]) -> dict[str, Any]:
    """The config's llm-lanes application (the one built by app.main:build_app)."""
    for application in serve_config.get("applications") or []:
        if application.get("import_path") == APP_IMPORT_PATH:
            return application
    raise ValueError(f"no application with import_path {APP_IMPORT_PATH} in the serve config")


def is_overlay(document: Any) -> bool:
    return isinstance(document, dict) and "base" in document


def _split_key(key: str, what: str) -> list[str]:
    parts = key.split(".")
    if not key or any(not part for part in parts):
        raise OverlayError(f"{what} {key!r}: the key must be dotted names, e.g. args.router.num_replicas")
    return parts


def _root_for(document: dict[str, Any], parts: list[str], what: str, key: str) -> tuple[dict[str, Any], list[str]]:
    """Where a dotted key starts: `args.`/`runtime_env.` in the llm-lanes application, the rest at the top level."""
    if parts[0] in APPLICATION_KEYS:
        try:
            return llm_lanes_application(document), parts
        except ValueError as error:
            raise OverlayError(f"{what} {key!r}: {error}") from None
    return document, parts


def _parent_of(document: dict[str, Any], key: str, what: str, create: bool) -> tuple[dict[str, Any], str]:
    parts = _split_key(key, what)
    node, parts = _root_for(document, parts, what, key)
    walked: list[str] = []
    for part in parts[:-1]:
        walked.append(part)
        if part not in node or (node[part] is None and create):
            if not create:
                raise OverlayError(f"{what} {key!r}: the config has no {'.'.join(walked)}")
            node[part] = {}
        child = node[part]
        if not isinstance(child, dict):
            raise OverlayError(f"{what} {key!r}: {'.'.join(walked)} is {child!r} ({type(child).__name__}), "
                               f"not a mapping, so it has no keys to set (lists are replaced whole: set "
                               f"{'.'.join(walked)} itself)")
        node = child
    return node, parts[-1]


def parse_set(text: str) -> tuple[str, Any, str]:
    """`dotted.key=value` -> (key, value parsed as YAML, the value's raw text); OverlayError names the key."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep:
        raise OverlayError(f"--set {text!r}: expected KEY=VALUE, e.g. args.router.num_replicas=2")
    _split_key(key, "--set")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as error:
        problem = str(error).splitlines()[0]
        raise OverlayError(f"--set {key}: the value {raw!r} is not valid YAML ({problem}); quote it") from None
    return key, value, raw


def apply_set(document: dict[str, Any], text: str) -> None:
    """One `--set dotted.key=value`, in place; intermediate mappings are created as needed."""
    key, value, raw = parse_set(text)
    parent, leaf = _parent_of(document, key, "--set", create=True)
    if isinstance(parent.get(leaf), str) and isinstance(value, (int, float, bool)):
        value = raw.strip()  # an env var stays a string: "75", not 75
    parent[leaf] = value


def apply_sets(document: dict[str, Any], sets: Iterable[str]) -> dict[str, Any]:
    for text in sets:
        apply_set(document, text)
    return document


def unset(document: dict[str, Any], key: str) -> None:
    parent, leaf = _parent_of(document, key, "unset", create=False)
    if leaf not in parent:
        raise OverlayError(f"unset {key!r}: the base config has no such key")
    del parent[leaf]


def _resolve_base(base: str, overlay_path: Path) -> Path:
    candidate = Path(base)
    if candidate.is_absolute():
        return candidate
    for root in (REPO, overlay_path.parent):
        if (root / candidate).exists():
            return root / candidate
    raise OverlayError(f"{overlay_path}: base {base!r} not found (a path from the repository root {REPO})")


def merge_overlay(base_document: dict[str, Any], overlay: dict[str, Any], where: str = "overlay") -> dict[str, Any]:
    """The serve config an overlay describes, from its base's (already merged) document."""
    if "applications" in overlay:
        raise OverlayError(f"{where}: an overlay changes the llm-lanes application through args: and runtime_env:, "
                           "not applications:")
    merged = copy.deepcopy(base_document)
    for key in overlay.get("unset") or []:
        try:
            unset(merged, key)
        except OverlayError as error:
            raise OverlayError(f"{where}: {error}") from None
    top = {k: v for k, v in overlay.items() if k not in OVERLAY_KEYS + APPLICATION_KEYS}
    merged = deep_merge(merged, top)
    application_part = {k: overlay[k] for k in APPLICATION_KEYS if k in overlay}
    if application_part:
        try:
            application = llm_lanes_application(merged)
        except ValueError as error:
            raise OverlayError(f"{where}: {error}") from None
        application.update(deep_merge(application, application_part))
    return merged


def load_serve_config(path: str | Path, sets: Iterable[str] = (), _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The full serve config at `path` (a shipped config, or an overlay merged onto its base), with `sets` applied."""
    path = Path(path)
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise OverlayError(f"cannot read serve config {path}: {error.strerror or error}") from None
    if not isinstance(document, dict):
        raise OverlayError(f"{path}: not a serve config (a YAML mapping)")
    if is_overlay(document):
        base_path = _resolve_base(str(document["base"]), path)
        if base_path.resolve() in _seen:
            raise OverlayError(f"{path}: its bases form a loop")
        base = load_serve_config(base_path, (), _seen + (path.resolve(),))
        document = merge_overlay(base, document, str(path))
    return apply_sets(document, sets)


def set_label(sets: Iterable[str]) -> str:
    """A short, file-name-safe suffix naming the --set values: `max_num_batched_tokens2048`."""
    pieces = []
    for text in sets:
        key, _, raw = parse_set(text)
        pieces.append(re.sub(r"[^A-Za-z0-9_.-]+", "", key.split(".")[-1] + raw.strip()))
    return "-".join(pieces)


@dataclass(frozen=True)
class ConfigRef:
    """A serve config the load generator starts: a file (shipped config or overlay) and --set values on it."""

    path: str
    sets: tuple[str, ...] = field(default_factory=tuple)

    @property
    def label(self) -> str:
        suffix = set_label(self.sets)
        return Path(self.path).stem + (f"-{suffix}" if suffix else "")

    def needs_merge(self) -> bool:
        if self.sets:
            return True
        try:
            return is_overlay(yaml.safe_load(Path(self.path).read_text(encoding="utf-8")))
        except (OSError, yaml.YAMLError):
            return False  # `serve run` reports a missing or broken file itself

    def load(self) -> dict[str, Any]:
        return load_serve_config(self.path, self.sets)

    def servable_path(self, out_dir: str | Path) -> str:
        """A file `serve run` can start: the config itself when it is a plain serve config without --set, else the
        merged config written to out_dir/serve-config-<label>.yaml."""
        if not self.needs_merge():
            return self.path
        out = Path(out_dir) / f"serve-config-{self.label}.yaml"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(dump(self.load(), self), encoding="utf-8")
        return str(out)


def as_ref(config: "str | Path | ConfigRef") -> ConfigRef:
    return config if isinstance(config, ConfigRef) else ConfigRef(str(config))


def dump(document: dict[str, Any], ref: ConfigRef | None = None) -> str:
    header = ""
    if ref is not None:
        header = f"# Merged by load_tests.overlay from {ref.path}" + "".join(f" --set {s}" for s in ref.sets) + "\n"
    return header + yaml.safe_dump(document, sort_keys=False)


def add_set_argument(parser: argparse.ArgumentParser, help_suffix: str = "") -> None:
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="set",
                        help="change one value of the serve config after merging its overlay: dotted KEY "
                             "(args.… / runtime_env.… for the llm-lanes application, else the top level), YAML "
                             f"VALUE; repeat for more{help_suffix}")


class _ServeConfigAction(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        refs = list(getattr(namespace, self.dest) or [])
        refs.append(ConfigRef(str(values)))
        setattr(namespace, self.dest, refs)


class _SetForLastConfigAction(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        refs = list(getattr(namespace, "serve_config") or [])
        if not refs:
            parser.error(f"--set {values}: put --set after the --serve-config it changes")
        try:
            parse_set(str(values))
        except OverlayError as error:
            parser.error(str(error))
        last = refs[-1]
        refs[-1] = ConfigRef(last.path, last.sets + (str(values),))
        setattr(namespace, "serve_config", refs)


def add_serve_config_arguments(parser: argparse.ArgumentParser, help_text: str) -> None:
    """`--serve-config CONFIG [--set KEY=VALUE ...]`, repeatable: each --set changes the --serve-config before it.
    The parsed value (args.serve_config) is a list of ConfigRef."""
    parser.add_argument("--serve-config", action=_ServeConfigAction, default=[], metavar="CONFIG", help=help_text)
    parser.add_argument("--set", action=_SetForLastConfigAction, metavar="KEY=VALUE", dest="set_for_config",
                        help="change one value of the --serve-config before it (after merging its overlay): dotted "
                             "KEY (args.… / runtime_env.… for the llm-lanes application, else the top level), YAML "
                             "VALUE; repeat for more")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load_tests.overlay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="a serve config or an overlay (load_tests/configs/*.yaml)")
    add_set_argument(parser)
    parser.add_argument("--out", default=None, help="write the merged config here (default: stdout)")
    parser.add_argument("--out-dir", default=None,
                        help="print the path `serve run` should start: the config itself if nothing needs merging, "
                             "else the merged config written into this folder")
    parser.add_argument("--label", action="store_true", help="print the run's label (file stem + --set values)")
    parser.add_argument("--validate", action="store_true",
                        help="also validate the llm-lanes args with the app's schema (imports app.config)")
    args = parser.parse_args(argv)
    ref = ConfigRef(args.config, tuple(args.set))
    try:
        if args.label:
            print(ref.label)
            return 0
        document = ref.load()
        if args.validate:
            from app.config import ConfigError, load_app_config

            try:
                load_app_config(llm_lanes_application(document).get("args") or {})
            except (ConfigError, ValueError) as error:
                print(error, file=sys.stderr)
                return 1
        if args.out:
            Path(args.out).write_text(dump(document, ref), encoding="utf-8")
        if args.out_dir:
            print(ref.servable_path(args.out_dir))
        if not (args.out or args.out_dir):
            sys.stdout.write(dump(document, ref))
    except OverlayError as error:
        print(error, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
