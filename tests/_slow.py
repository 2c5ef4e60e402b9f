"""The checks marked ``slow`` (``pytest -m "not slow"`` leaves them out), in one place: the suite passed 25 minutes
on the 2-core CPU machine (25:48 with Wan, LTX-Video, LoRA and their training in it), so its heaviest checks whose
subject another, lighter check also covers run in the full command only (README: Test). Each entry: why, and the
test ids it matches (regular expressions searched in the node id). Measured with ``pytest --durations=0``; what a
line takes there in parentheses."""

SLOW: dict[str, str] = {
    # float32 parity against the reference is the proof; a bf16 run only shows the model runs in bf16 (62 s, 41 tests)
    "bfloat16 runs of the model parity classes": r"::test_bfloat16_run$",
    # the float32 cases of the same kernels and masks stay (36 s, 20 tests)
    "bfloat16 cases of the attention kernels": r"^tests/test_attention\.py::.*bfloat16",
    # one device against a mesh: each family's model and pipeline mesh tests stay (62 s)
    "the remat / offload strategies and the SD pipeline on a mesh":
        r"^tests/test_parallel\.py::(test_strategy_equals_single_device|test_pipeline_on_mesh_equals_single_device)",
    # the trainer's step: its single-device, resume and loss tests stay (82 s)
    "cached latents and the sharded train step":
        r"^tests/test_train\.py::(test_cached_latents_give_the_same_loss|test_sharded_step_equals_single_device)",
    # train.run: the folder source, synthetic resume and SIGTERM stay (53 s)
    "more train.run sources and resumes":
        r"^tests/test_train_run\.py::(test_fine_tune_the_shipped_digits_model|test_run_resumes_on_the_mesh|"
        r"test_a_signal_saves_a_checkpoint_and_the_run_resumes_exactly\[SIGINT\]|test_run_from_each_source\[(hf|tfrecord)\])",
    # the SDXL and Flux fine-tunes' runs (their option and micro-conditioning tests stay; 59 s)
    "SDXL's and Flux's training runs":
        r"^tests/test_train_(sdxl|flux)\.py::(test_cache_holds|test_train_step_calls|test_sdxl_trains|test_export_loads|"
        r"test_loss_is_diffusers|test_flux_trains)",
    # processes started by the test (52 s)
    "two processes, a wheel build":
        r"^tests/test_(multihost\.py|cache\.py::test_two_processes|scripts\.py::test_wheel)",
    # each ControlNet kind's pipeline parity stays (45 s)
    "guess mode, pooled and multi-net ControlNet variants":
        r"^tests/test_controlnet(_union)?\.py::(test_pooled_net_forces_guess_mode|test_sdx?l?_multicontrolnet_guess_mode|"
        r"test_from_unet_is_diffusers_from_unet|test_one_image_in_guess_mode|test_two_union_nets)",
    # SDXL ControlNet inpainting with an ordinary UNet and with padding_mask_crop: its 9-channel parity at diffusers'
    # defaults, SD's 4-channel and cropped ControlNet cases and test_inpaint's SDXL blending stay (29 s)
    "SDXL ControlNet inpainting with an ordinary UNet, cropped":
        r"^tests/test_controlnet_image\.py::(test_sdxl_controlnet_inpaint_matches_diffusers\[4|"
        r"test_controlnet_inpaint_crops_the_control_image_as_diffusers\[True\])",
    # the hand-off from a 9-channel inpainting base: the ordinary base's hand-off (the same inpainting refiner) and the
    # 9-channel UNet's parity (test_inpaint.py) stay (22 s)
    "the inpainting hand-off from a 9-channel base":
        r"^tests/test_handoff\.py::test_inpainting_base_hands_off_to_the_refiner_as_inpainting\[9\]",
    # SD 1.x/2.x and SDXL base single files stay (19 s)
    "the refiner's and the inpainting UNets' single files":
        r"^tests/test_single_file\.py::(test_sdxl_refiner_from_its_single_file|test_sdx?l?_inpainting_nine_channel_unet)",
    # Wan's square training runs take the same step; the non-square batches, sizes and refusals stay (18 s)
    "Wan's train step on non-square clips": r"^tests/test_train_wan\.py::test_a_non_square_size_trains$",
    # the scanned / rematerialised forward passes stay (18 s)
    "rematerialised gradients of the video and Flux transformers": r"::test_remat_gives_the_same_gradients$",
    # Wan's guidance halves of two lengths, run apart against diffusers (a loop of its own; its cheap check stays; 18 s)
    "Wan's guidance halves of two lengths":
        r"^tests/test_wan_pipeline\.py::test_halves_of_two_lengths_run_apart_as_diffusers$",
    # the same images from another loading or hand-over path: the plain pipelines' parity stays (35 s)
    "pipelines on a mesh, scanned loading, lone-file and refiner hand-overs":
        r"^tests/(test_(wan|flux)_pipeline\.py::test_mesh_equals_one_device|test_wan_v2v\.py::test_mesh_equals_one_device|"
        r"test_pipeline\.py::test_load_pipeline_with_scan_layers_gives_the_same_images|"
        r"test_sdxl\.py::test_lightning_unet_from_a_lone_file_with_trailing_euler|"
        r"test_generate_families\.py::test_sdxl_single_file_hands_over_to_the_refiner)",
    # IP-Adapter Plus through the SD and SDXL pipelines, and SDXL's image-to-image with an adapter: the Plus projection
    # and UNet parity (test_ip_adapter.py), the plain adapter's pipeline parity and SD's image-to-image stay (74 s)
    "IP-Adapter Plus through the pipelines, SDXL image-to-image with an adapter":
        r"^tests/test_ip_adapter_pipeline\.py::(test_plus_adapter_from_a_dict_matches_diffusers|"
        r"test_image_to_image_takes_the_adapter_as_diffusers\[sdxl\])",
    # several images per IP-Adapter: the UNet's 1-and-2 images on the unstacked UNet, SD's two images on one adapter
    # and SDXL's two adapters with 1 and 2 images stay (Plus and the stacked UNet: 20, 20, 16 s; SDXL's two images,
    # SD's two adapters: 15, 39 s, on a loaded machine)
    "more IP-Adapter image counts":
        r"^tests/test_ip_adapter(\.py::(test_several_plus_images_match_diffusers|"
        r"test_several_images_per_adapter_match_diffusers\[stacked\])|"
        r"_pipeline\.py::(test_two_images_on_one_adapter_match_diffusers\[sdxl\]|"
        r"test_two_adapters_with_one_and_two_images_match_diffusers\[sd\]))",
    # IP-Adapter masks: SD's two adapters with one masked and the stacked UNet's masks; SDXL's two adapters, each
    # pipeline's one adapter with two masked images and the unstacked UNet's masks stay (9, 16 s)
    "SD's two IP-Adapters with one masked, masks on the stacked UNet":
        r"^tests/test_ip_adapter(_masks\.py::test_two_adapters_one_masked_match_diffusers\[sd\]|"
        r"\.py::test_masked_images_match_diffusers\[stacked\])",
    # the ControlNet-Union image pipelines at diffusers' defaults and their recompile sweeps: their parity with
    # per-image scales and windows stays, and the union text-to-image and SDXL image-to-image / inpainting sweeps stay
    # (about 12, 11, 10.5, 10.5 s in the fresh-clone CI)
    "ControlNet-Union image pipelines at their defaults, their recompile sweeps":
        r"^tests/(test_controlnet_union_image\.py::test_union_(img2img|inpaint)_matches_diffusers\[kw0\]|"
        r"test_recompile\.py::test_values_compile_nothing_after_the_first_call\[StableDiffusionXLControlNetUnion"
        r"(Img2Img|Inpaint)Pipeline\])",
}
