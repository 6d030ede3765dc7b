"""ConfigError, at the bottom of the layers so that config.py and the config-level modules below it
(partition, flops, device_spec) raise one error class; users import it from `megatronapp.config`."""


class ConfigError(ValueError):
    """A user-fixable configuration problem; the message names the field and the fix."""
