"""The simulated GPU: an executor that prices each step with a roofline cost model of a GPU on a
virtual clock (`executor.py`, `cost_model.py`), decode attention per kernel variant (`decode_attention.py`)
at the efficiency of each hardware's kernel table (`kernel_table.py`), the GPUs it knows
(`hardware.py`), how their memory splits into weights, activations and KV cache (`memory.py`), and
the cpu-local calibration (`calibrate.py`)."""
