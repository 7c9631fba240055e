"""Errors the engine raises for requests it cannot take. All are ValueErrors (the engine's word
for "this request is invalid"); subclasses let a caller answer with a precise code."""


class PromptTooLongError(ValueError):
    """The prompt leaves no room to generate within the model's context."""
