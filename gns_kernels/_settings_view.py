"""A read-only attribute that reads one setting of an object's frozen configuration (the
controller's ControllerConfig, the hook states' GNSConfig): one owner per setting, the
config; the object shows it."""
from __future__ import annotations

__all__ = ["setting_of"]


def setting_of(config_attr: str, name: str, doc: str) -> property:
    """A read-only property returning ``getattr(getattr(self, config_attr), name)``."""
    return property(lambda self: getattr(getattr(self, config_attr), name), doc=doc)
