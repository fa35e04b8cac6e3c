import json
from pathlib import Path


def save_checkpoint(iteration, model, optimizer=None, opt_param_scheduler=None, **kwargs):
    """Records which keys Megatron would write (the model's sharded_state_dict)."""
    from megatron.training import get_args

    out = Path(get_args().save) / f"iter_{iteration:07d}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "keys.json").write_text(json.dumps(sorted(model[0].sharded_state_dict().keys())))
