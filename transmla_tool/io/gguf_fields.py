"""Values of GGUF metadata fields as gguf's reader holds them (a field's data indexes its parts)."""

from __future__ import annotations


def field_text(field) -> str:
    """A string field's value."""
    return bytes(field.parts[field.data[0]]).decode()


def field_number(field) -> int:
    """An integer field's value."""
    return int(field.parts[field.data[0]][0])
