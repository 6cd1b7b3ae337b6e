"""Attention layers that carry ropelib's encodings: softmax attention (:mod:`~ropelib.attention.mha`, with the
encodings plugged in by :mod:`~ropelib.attention.plugs`) and linear attention (:mod:`~ropelib.attention.linear`)."""
