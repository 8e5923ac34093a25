from lit_template.data.base import ImageDataModule
from lit_template.data.digits import DigitsDataModule
from lit_template.data.text import TextDataModule
from lit_template.data.vision import CIFAR10DataModule, MNISTDataModule

__all__ = ["CIFAR10DataModule", "DigitsDataModule", "ImageDataModule", "MNISTDataModule", "TextDataModule"]
