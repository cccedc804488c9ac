"""Which value path each attention layer takes: as transformers picks a layer's attention function by name from
`ALL_ATTENTION_FUNCTIONS`, a ResFormer attention layer gets its value path from `VALUE_PATHS` by the role its config
gives it (`VARIANTS` in `configuration_resformer.py`). A variant is one path class plus its `VARIANTS` entry.

Imports only sibling files (copied for `trust_remote_code`).
"""

from __future__ import annotations

from .configuration_resformer import CORRECT, GATE, MIX, MIX_ALL, PLAIN, REUSE, ResFormerConfig
from .depth_weighted_average import DenseValues
from .neutreno import NeutrenoValues
from .value_gate import GatedValues
from .value_residual import MixedValues, SVFormerValues, ValuePath

#: The path of a receiving layer, by role. Each names the path of layer 0 that feeds it (`first_values`).
VALUE_PATHS: dict[str, type[ValuePath]] = {
    PLAIN: ValuePath,
    MIX: MixedValues,
    MIX_ALL: DenseValues,
    REUSE: SVFormerValues,
    CORRECT: NeutrenoValues,
    GATE: GatedValues,
}


def value_path_for(config: ResFormerConfig, layer_idx: int) -> ValuePath:
    """Layer `layer_idx`'s path: its role's when it receives; when a later layer reads its values, the path that
    hands them on (layer 0: its receivers' `first_values`; `dense`: the receiving path itself); else Llama's."""
    receiving = VALUE_PATHS[config.value_residual_spec.role]
    if config.value_residual_layer_roles[layer_idx] != PLAIN:
        return receiving(config, layer_idx)
    if layer_idx in config.value_residual_sources and layer_idx < max(config.value_residual_receivers, default=0):
        source = receiving.first_values if layer_idx == 0 and receiving.first_values else receiving
        return source(config, layer_idx)
    return ValuePath(config, layer_idx)


__all__ = ["VALUE_PATHS", "value_path_for"]
