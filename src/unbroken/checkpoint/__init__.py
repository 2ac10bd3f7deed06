"""One checkpoint's bytes (layer 1): capture → write → commit; read → verify → decode.

The save path: ``adapting`` (a state's objects seen through adapters) → ``snapshot`` (the capture that
blocks training) → ``persist`` (the files written, then the commit: manifest last, a rename) → with
``incremental``, ``chunks`` (content-addressed tensor bytes). Background saves: ``background/``.
The restore path: ``reader`` (verify every byte against the manifest, then decode). Around them:
``manifests`` (listing without torch, for the CLI), ``discovery`` (a store's committed checkpoints),
``tags``, ``runid`` (a run folder's identity, made once) and ``targets`` (where a tool may write a path a
user named)."""
