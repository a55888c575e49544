"""The `shardemu` command's compilation cache: XLA's compiles kept on disk between runs.

Counting a layout is compiling its pieces (`accounting/count.py`), and on a laptop's CPU
that is most of what a plan or a search costs. JAX can keep each compiled program in a
folder and load it again in a later process whose program is the same (its persistent
compilation cache: "Persistent compilation cache", JAX documentation; MaxText turns it
on by default for the same reason). The command turns it on for its own process, so a
second plan or search of a model loads what the first compiled instead of compiling it
again: the same programs, so the same counts and predictions.

- where: `$SHARDEMU_CACHE`, else `$XDG_CACHE_HOME/shardemu/xla`, else
  `~/.cache/shardemu/xla`; `SHARDEMU_CACHE=off` turns it off;
- every compile is kept, however short (JAX keeps only those over 1 s by default; a
  piece of a tiny model compiles in a tenth of that, and its entry is a few kB: a whole
  GPT-3 175B search on 1536 A100s left 6.7 MB);
- a cache the user configured for JAX (`JAX_COMPILATION_CACHE_DIR`, or
  `jax_compilation_cache_dir` already set) is theirs: left as it is.

Only the command does this; a program that imports shardemu keeps JAX's own settings.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

OFF = "off"


@dataclass(frozen=True)
class CacheSettings:
    """The JAX settings the command's cache is made of."""

    folder: Path
    min_compile_time_s: float = 0.0  # every compile (JAX's default keeps those over 1 s)


def cache_settings(environ: Mapping[str, str], configured: str | None) -> CacheSettings | None:
    """The cache the command should use, from its environment and JAX's configured
    folder (`configured`); None where the user configured JAX's own or turned it off."""
    if configured or environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    given = environ.get("SHARDEMU_CACHE", "").strip()
    if given.lower() == OFF:
        return None
    if given:
        return CacheSettings(Path(given).expanduser())
    home = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return CacheSettings(Path(home).expanduser() / "shardemu" / "xla")


def use_compile_cache(settings: CacheSettings | None) -> bool:
    """Turn the command's cache on with `settings` (`cache_settings`; None: nothing to
    do); whether it is on. A folder that cannot be made or written is said in one
    warning, and nothing is cached."""
    if settings is None:
        return False
    try:
        settings.folder.mkdir(parents=True, exist_ok=True)
        writable = os.access(settings.folder, os.W_OK)
    except OSError:
        writable = False
    if not writable:
        logging.getLogger("shardemu").warning(
            f"cannot write the compilation cache {settings.folder}: every program is compiled "
            f"anew; set SHARDEMU_CACHE to a writable folder, or to {OFF!r}"
        )
        return False
    jax.config.update("jax_compilation_cache_dir", str(settings.folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", settings.min_compile_time_s)
    share_across_device_sets()
    return True


def share_across_device_sets() -> bool:
    """Let one cache entry serve every set of devices that runs the same program: a
    pipeline's stages run one program each on their own devices, and JAX's cache key
    holds the device ids on the CPU, so each stage compiled it again (a search's winner
    verified on 16 stages, `run/verify.py`: 132 compiles, 22 of them distinct; 70 -> 27
    s). JAX leaves the ids out of the key on GPUs (`cache_key.get`:
    `strip_device_assignment`, so that processes share entries) and loads an entry onto
    the devices asked for (`deserialize_executable(..., executable_devices, ...)`); the
    command does so on the CPU too. A private function of JAX: where it is gone, each
    stage compiles as before (False)."""
    from jax._src import cache_key

    hash_options = getattr(cache_key, "_hash_serialized_compile_options", None)
    if hash_options is None:
        return False
    if getattr(hash_options, "strips_devices", False):
        return True  # done before

    def stripped(hash_obj: Any, options: Any, strip_device_assignment: bool = False) -> Any:
        return hash_options(hash_obj, options, strip_device_assignment=True)

    stripped.strips_devices = True  # type: ignore[attr-defined]
    cache_key._hash_serialized_compile_options = stripped
    return True


def command_cache() -> bool:
    """The command's cache, from its environment and JAX's configuration: on, or not."""
    return use_compile_cache(cache_settings(os.environ, jax.config.jax_compilation_cache_dir))
