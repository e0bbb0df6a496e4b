"""The install layout: every source package is listed in setup.cfg under the signmuon namespace."""

import configparser
import pathlib

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
