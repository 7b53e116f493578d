"""Models for the pretraining workload. They know nothing of compression or communication."""

from gradzip.models.bert import (
    MODEL_SIZES,
    BertConfig,
    BertForPreTraining,
    BertPreTrainingOutput,
    bert_config,
    load_hf_state_dict,
    num_parameters,
    parameter_shapes,
)

__all__ = [
    "MODEL_SIZES",
    "BertConfig",
    "BertForPreTraining",
    "BertPreTrainingOutput",
    "bert_config",
    "load_hf_state_dict",
    "num_parameters",
    "parameter_shapes",
]
