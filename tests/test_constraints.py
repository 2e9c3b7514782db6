"""The dependencies: Django's range in pyproject.toml, and the pins scripts/test installs with
(constraints/), so that a new release of a dependency cannot turn CI red or green by itself."""

from __future__ import annotations

import re
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.conftest import ROOT

pytestmark = pytest.mark.one_django

CONSTRAINTS = ROOT / "constraints"


def project() -> dict[str, object]:
    with open(ROOT / "pyproject.toml", "rb") as file:
        data: dict[str, object] = tomllib.load(file)["project"]
    return data


def requirements(names: list[str]) -> dict[str, Requirement]:
    return {canonicalize_name(req.name): req for req in map(Requirement, names)}


def pins(path: str) -> dict[str, Version]:
    """The ``name==version`` lines of a constraints file, and of the files it reads with ``-c``."""
    found: dict[str, Version] = {}
    for line in (CONSTRAINTS / path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-c "):
            found.update(pins(line[3:].strip()))
        elif line:
            name, _, version = line.partition("==")
            assert version, f"{path}: {line!r} is not pinned with =="
            found[canonicalize_name(name)] = Version(version)
    return found


def djangos_tested() -> list[str]:
    """The Django series scripts/test tests by default."""
    match = re.search(r'djangos="\$\{DBQUEUE_DJANGOS:-([0-9. ]+)\}"', (ROOT / "scripts" / "test").read_text())
    assert match is not None
    return match[1].split()


def test_django_is_required_from_a_5_2_release_and_below_the_first_untested_major():
    django = requirements(project()["dependencies"])["django"]
    floor = min(Version(spec.version) for spec in django.specifier if spec.operator == ">=")
    assert floor.release[:2] == (5, 2) and floor.micro > 0
    assert not django.specifier.contains("7.0") and not django.specifier.contains("5.2.0")
    for series in djangos_tested():
        major = int(series.split(".")[0])
        assert major < 7 and django.specifier.contains(f"{series}.99"), series


def test_every_tested_django_has_a_constraints_file_that_pins_every_dev_package():
    data = project()
    needed = requirements(data["dependencies"]) | requirements(data["optional-dependencies"]["dev"])
    django = needed["django"]
    assert "django" not in pins("dev.txt"), "dev.txt pins no Django: each series' file does"
    for series in djangos_tested():
        pinned = pins(f"django-{series}.txt")
        assert pinned["django"].release[:2] == tuple(map(int, series.split("."))), series
        assert django.specifier.contains(pinned["django"]), (series, pinned["django"])
        for name, requirement in needed.items():
            assert name in pinned, f"{name} is not pinned for Django {series}"
            assert requirement.specifier.contains(pinned[name], prereleases=True), (name, pinned[name])
        # The build backend (pyproject.toml's build-system) is pinned too.
        assert "setuptools" in pinned


def test_the_classifiers_name_the_djangos_tested():
    classifiers = project()["classifiers"]
    tested = {f"Framework :: Django :: {series}" for series in djangos_tested()}
    listed = {item for item in classifiers if re.fullmatch(r"Framework :: Django :: [0-9.]+", item)}
    assert listed == tested
