"""CLIP score of generated images against their captions, with a CLIP model from a LOCAL folder (nothing is
downloaded): 100 * max(cos(image embedding, caption embedding), 0) per image (Hessel et al., 2021, w = 1 as in
torchmetrics' `CLIPScore` and most text-to-image papers).

    scorer = ClipScorer("/models/clip-vit-large-patch14")       # a transformers CLIP folder
    scores = scorer(images_uint8, captions)                      # [B] float, 0..100

Captions longer than the text tower's context are truncated (as torchmetrics does).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F


class ClipScorer:
    def __init__(self, path: str, device: str | torch.device = "cpu"):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"CLIP model folder not found: {path} (a local transformers CLIP folder with "
                                    f"config.json, the weights and the processor files)")
        from transformers import CLIPModel, CLIPProcessor

        self.device = torch.device(device)
        self.model = CLIPModel.from_pretrained(path, local_files_only=True).eval().to(self.device)
        self.processor = CLIPProcessor.from_pretrained(path, local_files_only=True)
        self.max_text = int(self.model.config.text_config.max_position_embeddings)

    @torch.no_grad()
    def embed(self, images: np.ndarray, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 images [B, H, W, 3] and B captions -> L2-normalised (image, text) embeddings [B, P] each."""
        if len(images) != len(captions):
            raise ValueError(f"{len(images)} images but {len(captions)} captions")
        x = self.processor(text=list(captions), images=[np.asarray(im) for im in images], return_tensors="pt",
                           padding=True, truncation=True, max_length=self.max_text)
        img = self.model.get_image_features(pixel_values=x["pixel_values"].to(self.device))
        txt = self.model.get_text_features(input_ids=x["input_ids"].to(self.device),
                                           attention_mask=x["attention_mask"].to(self.device))
        img, txt = (getattr(t, "pooler_output", t) for t in (img, txt))  # some versions return an output object
        return F.normalize(img.float(), dim=-1), F.normalize(txt.float(), dim=-1)

    def __call__(self, images: np.ndarray, captions: list[str]) -> np.ndarray:
        img, txt = self.embed(images, captions)
        return (100.0 * (img * txt).sum(-1).clamp_min(0.0)).cpu().numpy()
