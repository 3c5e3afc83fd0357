"""A group option's YAML (experiments/<group>/<option>.yaml) repeats only its schema's defaults.

The dataclass is where a default lives; a YAML value that differs from it would make the schema
lie about the option (and `--cfg job` differ from what the class says). A value the schema leaves
MISSING is the YAML's to give.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from testbed.config import GROUP_SCHEMAS
from testbed.paths import config_dir

pytestmark = pytest.mark.unit

OPTIONS = [(group, name) for group, options in GROUP_SCHEMAS.items() for name in options]


def differences(yaml: dict[str, Any], schema: Any, prefix: str = "") -> list[str]:
    """The keys of ``yaml`` whose values are not ``schema``'s defaults."""
    found = []
    for key, value in yaml.items():
        if key == "defaults":
            continue
        where = f"{prefix}{key}"
        if key not in schema.keys():
            found.append(f"{where}: not in the schema")
        elif OmegaConf.is_missing(schema, key):
            continue
        elif isinstance(value, dict) and OmegaConf.is_dict(schema[key]):
            found += differences(value, schema[key], f"{where}.")
        else:
            default = OmegaConf.to_container(schema, enum_to_str=True)[key]
            default = default.value if isinstance(default, enum.Enum) else default
            if value != default:
                found.append(f"{where}: {value!r} in the YAML, {default!r} in the schema")
    return found


@pytest.mark.parametrize(("group", "name"), OPTIONS, ids=[f"{g}={n}" for g, n in OPTIONS])
def test_yaml_repeats_only_the_schemas_defaults(group: str, name: str) -> None:
    path = Path(config_dir()) / group / f"{name}.yaml"
    assert path.exists(), f"{group}={name}: no {path}"
    yaml = OmegaConf.to_container(OmegaConf.load(path))
    schema = OmegaConf.structured(GROUP_SCHEMAS[group][name])
    assert not differences(yaml, schema), f"{path}: " + "; ".join(differences(yaml, schema))


def test_a_differing_value_is_found() -> None:
    schema = OmegaConf.structured(GROUP_SCHEMAS["data"]["mnist1d"])
    assert differences({"name": "mnist1d", "num_samples": 5000, "scaling": "weak"}, schema) == []
    assert differences({"num_samples": 4096, "seed": 1}, schema) == [
        "num_samples: 4096 in the YAML, 5000 in the schema", "seed: not in the schema"]
