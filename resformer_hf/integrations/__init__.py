"""The plugin's hooks into other engines: transformers' continuous-batching paged cache (`paged_cache`, installed by
`import resformer_hf`) and vLLM (`vllm_plugin`, loaded by vLLM through its `vllm.general_plugins` entry point).
PEFT's defaults live with the remote code (`remote_code/peft_support.py`): a folder loaded without the plugin needs
them too."""
