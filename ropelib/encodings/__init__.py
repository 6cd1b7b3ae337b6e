"""The position encodings other than rotations: absolute tables, relative biases and their ``flex_attention`` forms.

* :mod:`~ropelib.encodings.absolute`: sinusoidal and learned tables added to the input;
* :mod:`~ropelib.encodings.relative`: biases on the scores (Shaw, T5 buckets, ALiBi);
* :mod:`~ropelib.encodings.flex`: the same biases as ``flex_attention`` score modifications.

RoPE and its variants (M-RoPE, xPos, axial RoPE) are in :mod:`ropelib.rotary`.
"""
