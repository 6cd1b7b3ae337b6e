"""The position encodings other than RoPE itself: absolute tables, relative biases, their ``flex_attention`` forms, and RoPE's relatives.

* :mod:`~ropelib.encodings.absolute`: sinusoidal and learned tables added to the input;
* :mod:`~ropelib.encodings.relative`: biases on the scores (Shaw, T5 buckets, ALiBi);
* :mod:`~ropelib.encodings.flex`: the same biases as ``flex_attention`` score modifications;
* :mod:`~ropelib.encodings.variants`: xPos and 2-D axial RoPE.
"""
