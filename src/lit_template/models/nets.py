"""Plain ``nn.Module`` networks. A LitModule takes any of them as ``net``; add yours here and a yaml in conf/model."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from lit_template.errors import ConfigError


class MLP(nn.Module):
    """Flatten, then ``len(hidden)`` Linear-BatchNorm-ReLU blocks and a linear head."""

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        hidden: Sequence[int] = (128, 64),
        dropout: float = 0.0,
        batch_norm: bool = True,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for size in hidden:
            layers.append(nn.Linear(width, size))
            if batch_norm:
                layers.append(nn.BatchNorm1d(size))
            layers.append(nn.ReLU())
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = size
        layers.append(nn.Linear(width, num_classes))
        self.model = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class SmallCNN(nn.Module):
    """Two conv blocks and a linear head; works from 8x8 (digits) to 32x32 (CIFAR-10)."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, channels: Sequence[int] = (32, 64)) -> None:
        super().__init__()
        in_ch = input_shape[0]
        blocks: list[nn.Module] = []
        for ch in channels:
            blocks += [nn.Conv2d(in_ch, ch, 3, padding=1), nn.BatchNorm2d(ch), nn.ReLU(), nn.MaxPool2d(2)]
            in_ch = ch
        self.features = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_ch, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def torchvision_net(name: str, input_shape: Sequence[int], num_classes: int, small_input: bool = True) -> nn.Module:
    """A torchvision classification model by name (``resnet18``, ``resnet34``, ...), trained from scratch.

    ``small_input`` swaps a ResNet's 7x7/2 stem and max-pool for a 3x3/1 conv, as is usual for 8x8-32x32 images, and
    accepts any number of input channels.
    """
    import torchvision

    try:
        builder = torchvision.models.get_model_builder(name)
    except ValueError:
        known = ", ".join(n for n in torchvision.models.list_models(torchvision.models) if "resnet" in n)
        raise ConfigError(f"model.net.name={name!r} is not a torchvision model (for example: {known})") from None
    net = builder(weights=None, num_classes=num_classes)
    if isinstance(net, torchvision.models.ResNet) and (small_input or input_shape[0] != 3):
        net.conv1 = nn.Conv2d(input_shape[0], net.conv1.out_channels, 3, stride=1, padding=1, bias=False)
        if small_input:
            net.maxpool = nn.Identity()
    return net
