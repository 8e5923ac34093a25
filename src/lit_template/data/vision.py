"""MNIST and CIFAR-10 from torchvision: ``download=true`` for online users, a clear error when files are missing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lit_template.data.base import ImageDataModule
from lit_template.errors import ConfigError


class _TorchvisionDataModule(ImageDataModule):
    dataset_cls_name: str = ""
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()

    def __init__(self, data_dir: str = "data/", download: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.data_dir = str(data_dir)
        self.download = download

    def _dataset(self, train: bool, download: bool) -> Any:
        import torchvision
        from torchvision import transforms

        cls = getattr(torchvision.datasets, self.dataset_cls_name)
        transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(self.mean, self.std)])
        try:
            return cls(self.data_dir, train=train, download=download, transform=transform)
        except RuntimeError as err:
            if download or "not found" not in str(err).lower():
                raise
            raise ConfigError(
                f"{self.name} is not in data.data_dir={str(Path(self.data_dir).resolve())!r} and data.download=false: "
                "set data.download=true (needs network) or point data.data_dir at a folder that holds it"
            ) from None

    def prepare_data(self) -> None:
        # Lightning calls this on local rank zero only, so the download happens once per node.
        if self.download:
            self._dataset(train=True, download=True)
            self._dataset(train=False, download=True)

    def setup(self, stage: str | None = None) -> None:
        if self.data_train is not None:
            return
        self.data_train, self.data_val = self.split_train_val(self._dataset(train=True, download=False))
        self.data_test = self._dataset(train=False, download=False)


class MNISTDataModule(_TorchvisionDataModule):
    name = "MNIST"
    dataset_cls_name = "MNIST"
    dataset_num_classes = 10
    dataset_input_shape = (1, 28, 28)
    mean, std = (0.1307,), (0.3081,)


class CIFAR10DataModule(_TorchvisionDataModule):
    name = "CIFAR-10"
    dataset_cls_name = "CIFAR10"
    dataset_num_classes = 10
    dataset_input_shape = (3, 32, 32)
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
