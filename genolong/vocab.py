"""The DNA vocabulary: one token per base.

Prepared data stores these ids (uint8). Models trained from scratch on DNA use
`DNA_MODEL_VOCAB_SIZE` output rows (ids 5-7 unused: the size is a multiple of 8 so that the
embedding and lm_head GEMMs stay aligned). Fine-tuning a GLM checkpoint maps these ids onto
the checkpoint's own single-character token ids (genolong.model.vocab).
"""

DNA_BASES = ("A", "C", "G", "T", "N")
DNA_VOCAB = {base: i for i, base in enumerate(DNA_BASES)}
A_ID, C_ID, G_ID, T_ID, N_ID = range(5)
DNA_VOCAB_SIZE = len(DNA_BASES)
DNA_MODEL_VOCAB_SIZE = 8
# Reverse complement on token ids: A<->T, C<->G, N->N.
COMPLEMENT_ID = (T_ID, G_ID, C_ID, A_ID, N_ID)
