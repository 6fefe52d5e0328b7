"""The ``normswap_<type>`` model types, registered with transformers' Auto classes.

Importing this module registers nothing: ``register_auto_classes`` does, once, when called (by
``import normswap`` once transformers is imported, and by every path that loads a model).
"""

from __future__ import annotations

import transformers

from normswap.architectures import ARCHITECTURES
from normswap.kernels.patch import patch
from normswap.modeling import remote

_registered = False


def kernel_class(base: type, own_type: bool) -> type:
    """The RMSNorm class of ``base`` whose norms run normswap's kernels once built."""
    rms = remote.rms_class(base, own_type=own_type)

    def __init__(self, config, *args, **kwargs):
        rms.__init__(self, config, *args, **kwargs)

        patch(self)

    return type(rms.__name__, (rms,), {"__init__": __init__, "__module__": __name__})



def register_auto_classes() -> None:
    """Let the Auto classes load normswap-only model types (``normswap_<type>``) without remote code.

    Checkpoints that stock classes can hold keep their model type and load as stock models; for
    those, ``normswap.load`` gives the RMSNorm model. Only the light config classes are imported
    here: a family's modeling code is imported, and its model class registered, the first time
    a config of its normswap type is built, so ``import normswap`` stays fast.
    """
    global _registered
    if _registered:
        return
    _registered = True
    for model_type, architecture in ARCHITECTURES.items():
        try:
            config_class = transformers.CONFIG_MAPPING[model_type]
        except KeyError:  # a family this transformers version lacks
            continue
        own_config = getattr(remote, remote.CLASS_PREFIX + config_class.__name__)
        registering = _registering_config(own_config, config_class, architecture.auto_class)
        transformers.AutoConfig.register(own_config.model_type, registering, exist_ok=True)


def _registering_config(own_config: type, config_class: type, auto_class: str) -> type:
    """``own_config`` that registers its model class with ``auto_class`` when first built."""

    def __init__(self, *args, **kwargs):
        own_config.__init__(self, *args, **kwargs)
        auto = getattr(transformers, auto_class)
        if type(self) not in auto._model_mapping._extra_content:
            base = auto._model_mapping[config_class]
            auto.register(type(self), kernel_class(base, own_type=True), exist_ok=True)

    return type(own_config.__name__, (own_config,), {"__init__": __init__, "__module__": __name__})

