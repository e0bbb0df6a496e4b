"""The install layout: every source package is listed in setup.cfg under the signmuon namespace."""

import configparser
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _options():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    packages = config["options"]["packages"].split()
    mapping = dict(line.split(" = ") for line in config["options"]["package_dir"].strip().splitlines())
    return packages, mapping


def test_every_package_folder_is_installed():
    # A folder with an __init__.py missing from `packages` is left out of a normal (wheel)
    # install while an editable one still finds it: the failure users would see first.
    packages, mapping = _options()
    expected = set()
    for name, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            expected.add(".".join([name, *relative.parts]))
    assert expected == set(packages)


def test_no_generic_top_level_names():
    packages, mapping = _options()
    assert all(name.startswith("signmuon.") for name in packages)
    assert set(mapping) == {"signmuon.comm_hooks", "signmuon.optim", "signmuon.integrations", "signmuon.benchmarks"}


@pytest.mark.parametrize("framework", ["lightning", "accelerate", "transformers", "deepspeed", "torchft", "torchtitan"])
def test_each_integration_names_its_extra_when_the_framework_is_missing(framework):
    # sys.modules[name] = None makes `import name` fail as if the package were not installed.
    code = (
        f"import sys; sys.modules[{framework!r}] = None\n"
        "import signmuon.integrations, signmuon.optim, signmuon.comm_hooks  # never import a framework\n"
        f"assert {framework!r} not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
        f"import signmuon.integrations.{framework} as integration\n"
        + (
            "integration.initialize(model=None, config={'optimizer': {'type': 'SignMuon'}})\n"
            if framework == "deepspeed"
            else ""
        )
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert f"pip install 'signmuon[{framework}]'" in run.stderr.splitlines()[-1], run.stderr[-2000:]
