"""Every values file validates against values.schema.json, and the schema rejects what would break a cluster."""

from __future__ import annotations

import copy

import jsonschema
import pytest
from deploy_files import CHART, VALUES_FILES, load_values


def test_there_are_cuda_and_rocm_examples():
    names = {p.name for p in VALUES_FILES}
    assert {"values.yaml", "values-cuda.yaml", "values-mi300x.yaml"} <= names


def test_schema_is_a_valid_draft7_schema(schema):
    jsonschema.Draft7Validator.check_schema(schema)


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=lambda p: p.name)
def test_values_file_validates(schema, values_file):
    jsonschema.validate(load_values(values_file), schema, cls=jsonschema.Draft7Validator)


@pytest.mark.parametrize(
    ("path", "bad", "why"),
    [
        (("api", "replicas"), 2, "the control plane owns the SQLite queue"),
        (("gpu", "resourceName"), "amd.com/gpu", "nvidia vendor with an AMD resource"),
        (("gpu", "vendor"), "intel", "unknown vendor"),
        (("persistence", "mountPath"), "data/scalarlm", "relative mount path"),
        (("worker", "gpuMemoryUtilization"), 1.5, "more than the whole GPU"),
        (("worker", "tensorParallelSize"), 0, "no tensor-parallel rank"),
        (("slurm", "proctrack"), "proctrack/pgid", "unsupported proctrack"),
        (("auth", "apiKeys"), ["short"], "API keys must be long"),
        (("extraSettings",), {"engin": {}}, "typo in a settings section"),
        (("workers",), {}, "unknown top-level key"),
    ],
)
def test_schema_rejects_bad_values(schema, path, bad, why):
    values = copy.deepcopy(load_values(CHART / "values.yaml"))
    node = values
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(values, schema, cls=jsonschema.Draft7Validator)
