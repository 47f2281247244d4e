"""Errors raised by the encoder package.

ModelError
 ├── ConfigError          config.json, pooling or module files are bad or unsupported
 ├── CheckpointError      weights missing, corrupt, mis-shaped or of the wrong sha256
 ├── ModelNotFoundError   a model id that is neither a folder nor an installed model
 ├── PromptError          a prompt name the model does not have
 ├── CompileError         the encoder's passes cannot be compiled (`compile`)
 └── InputError           an input the encoder cannot take (not valid Unicode, ...)
      ├── TokenIdError        a pre-tokenized id outside the vocabulary
      └── InputTooLongError   more tokens than the model takes, with truncation off
"""


class ModelError(Exception):
    """Base class of every error this package raises."""


class ConfigError(ModelError):
    """A configuration file is missing a key, has a bad value, or names something unsupported."""


class CheckpointError(ModelError):
    """The weights file is missing, corrupt, or does not fit the architecture."""


class ModelNotFoundError(ModelError):
    """The model id names no local folder and no installed model."""


class PromptError(ModelError):
    """A request names a prompt that the model's configuration does not define."""


class CompileError(ModelError):
    """The encoder's passes cannot be compiled (one that reads its tensors' values, say): the
    server refuses to start rather than run them eagerly where compiled ones were asked for."""


class InputError(ModelError):
    """An input cannot be encoded."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index


class TokenIdError(InputError):
    """A pre-tokenized input holds an id outside the vocabulary."""


class InputTooLongError(InputError):
    """An input has more tokens than the model takes and truncation is off."""

    def __init__(self, index: int, length: int, limit: int, *, at_least: bool = False) -> None:
        counted = f"at least {length}" if at_least else str(length)
        super().__init__(
            f"input {index} has {counted} tokens, more than the model's limit of {limit}; "
            "shorten it or turn truncation on",
            index,
        )
        self.length = length
        self.limit = limit
