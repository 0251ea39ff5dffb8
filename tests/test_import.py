"""Importing the package is cheap and quiet: no torch, no Ray, no output.

The namespace's store actor imports ``collective.rendezvous.actor`` when it starts, so a
top-level torch import there would add over a second to the first group's creation.
"""

from __future__ import annotations

import subprocess
import sys

CHECK = (
    "import sys, collective, collective.rendezvous.membership, collective.rendezvous.actor; "
    "import collective.rendezvous.client; "
    "print(sorted(m for m in ('torch', 'ray', 'cupy') if m in sys.modules))"
)


def test_import_loads_neither_torch_nor_ray_and_prints_nothing() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"
    assert done.stderr == ""


def test_public_names_are_all_exported() -> None:
    import collective

    assert sorted(collective.__all__) == sorted(
        name
        for name in dir(collective)
        if not name.startswith("_")
        and name
        not in {
            "bulk",
            "checks",
            "frameworks",
            "groups",
            "ops",
            "ray_plugins",
            "registry",
            "rendezvous",
            "signature",
            "torch_backend",
            "types",
            "work",
        }
    )
