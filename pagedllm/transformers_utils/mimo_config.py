"""MiMo's config (`model_type: "mimo"`): Qwen2's, plus `num_nextn_predict_layers`, the
multi-token-prediction layers its checkpoint carries (`model.mtp_layers.*`). transformers has no
class for it (the Hub repo ships one as remote code), so it is registered here and a MiMo
checkpoint loads without `--trust-remote-code`."""

from __future__ import annotations

from transformers import AutoConfig, Qwen2Config
from transformers.models.auto.configuration_auto import CONFIG_MAPPING


class MiMoConfig(Qwen2Config):
    model_type = "mimo"

    def __init__(self, num_nextn_predict_layers: int = 0, **kwargs) -> None:
        self.num_nextn_predict_layers = num_nextn_predict_layers
        super().__init__(**kwargs)


def register_mimo_config() -> None:
    if "mimo" not in CONFIG_MAPPING:
        AutoConfig.register("mimo", MiMoConfig)
