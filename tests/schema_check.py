"""A small JSON-schema validator for the tests: the keywords the structured-output tests use (type, properties,
required, additionalProperties, items, enum, const, minimum/maximum, minLength/maxLength, minItems/maxItems,
anyOf, $ref to #/$defs). Raises AssertionError naming the path of the first violation."""

from __future__ import annotations

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is(value, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[kind])


def validate(value, schema, root=None, path: str = "$") -> None:
    root = schema if root is None else root
    if schema is True or schema == {}:
        return
    assert schema is not False, f"{path}: the schema allows nothing"
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return validate(value, root["$defs"][name], root, path)
    if "anyOf" in schema:
        errors = []
        for option in schema["anyOf"]:
            try:
                return validate(value, option, root, path)
            except AssertionError as e:
                errors.append(str(e))
        raise AssertionError(f"{path}: no anyOf option matches: {errors}")
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        assert any(_is(value, k) for k in kinds), f"{path}: {value!r} is not of type {kind}"
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    if "const" in schema:
        assert value == schema["const"], f"{path}: {value!r} != {schema['const']!r}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        assert value >= schema.get("minimum", value), f"{path}: {value} < minimum"
        assert value <= schema.get("maximum", value), f"{path}: {value} > maximum"
    if isinstance(value, str):
        assert len(value) >= schema.get("minLength", 0), f"{path}: shorter than minLength"
        assert len(value) <= schema.get("maxLength", len(value)), f"{path}: longer than maxLength"
    if isinstance(value, list):
        assert len(value) >= schema.get("minItems", 0), f"{path}: fewer than minItems"
        assert len(value) <= schema.get("maxItems", len(value)), f"{path}: more than maxItems"
        for i, item in enumerate(value):
            validate(item, schema.get("items", {}), root, f"{path}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name in schema.get("required", []):
            assert name in value, f"{path}: the required property {name!r} is missing"
        for name, item in value.items():
            if name in props:
                validate(item, props[name], root, f"{path}.{name}")
            else:
                extra = schema.get("additionalProperties", True)
                assert extra is not False, f"{path}: the property {name!r} is not allowed"
                if isinstance(extra, dict):
                    validate(item, extra, root, f"{path}.{name}")
