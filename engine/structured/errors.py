"""The one error structured output raises for a response format it cannot honour."""


class SchemaError(ValueError):
    """A response format Strata cannot honour: bad JSON, an invalid or unsupported schema or
    grammar, or one that would take more than the compile budget."""
