"""ResFormer's model code: exactly the files `save_pretrained` copies next to `config.json` for `trust_remote_code`
(configuration, modeling as its diff from Llama, the value residual, caches, tensor parallelism, loading checks).
They import only torch, transformers and each other (`from .name import`, the form the remote-code loader copies);
the plugin around them (registration, PEFT and paged-cache integration, serving, hub, conversion) lives outside.
Not `models/<name>/`: transformers' docstring tooling takes a file under such a folder for one of its own models."""
