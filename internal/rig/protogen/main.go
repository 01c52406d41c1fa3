// Command protogen generates Go code from .proto files as `protoc --go_out=DIR
// --go_opt=paths=source_relative` does, without protoc: the files are compiled by
// github.com/bufbuild/protocompile and the code written by protoc-gen-go's own generator
// (google.golang.org/protobuf/cmd/protoc-gen-go/internal_gengo, what its main runs). The tests of
// docs/handlers.md's Protobuf example use it in place of protoc, which is not installed here.
//
// Usage: protogen -out DIR -I IMPORT_DIR file.proto...
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/bufbuild/protocompile"
	"google.golang.org/protobuf/cmd/protoc-gen-go/internal_gengo"
	"google.golang.org/protobuf/compiler/protogen"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/pluginpb"
)

func main() {
	out := flag.String("out", ".", "the directory the Go files are written to (paths relative to their .proto's)")
	include := flag.String("I", ".", "the directory the .proto files' names and imports are relative to")
	flag.Parse()
	if err := run(*out, *include, flag.Args()); err != nil {
		fmt.Fprintln(os.Stderr, "protogen:", err)
		os.Exit(1)
	}
}

func run(out, include string, names []string) error {
	if len(names) == 0 {
		return fmt.Errorf("no .proto files")
	}
	c := protocompile.Compiler{Resolver: protocompile.WithStandardImports(&protocompile.SourceResolver{ImportPaths: []string{include}})}
	files, err := c.Compile(context.Background(), names...)
	if err != nil {
		return err
	}
	// Every file the request describes, each after what it imports.
	var all []*descriptorpb.FileDescriptorProto
	seen := map[string]bool{}
	var add func(fd protoreflect.FileDescriptor)
	add = func(fd protoreflect.FileDescriptor) {
		if seen[fd.Path()] {
			return
		}
		seen[fd.Path()] = true
		imports := fd.Imports()
		for i := range imports.Len() {
			add(imports.Get(i).FileDescriptor)
		}
		all = append(all, protodesc.ToFileDescriptorProto(fd))
	}
	for _, f := range files {
		add(f)
	}
	req := &pluginpb.CodeGeneratorRequest{FileToGenerate: names, ProtoFile: all, Parameter: proto.String("paths=source_relative")}
	gen, err := protogen.Options{}.New(req)
	if err != nil {
		return err
	}
	for _, f := range gen.Files {
		if f.Generate {
			internal_gengo.GenerateFile(gen, f)
		}
	}
	resp := gen.Response()
	if resp.Error != nil {
		return fmt.Errorf("%s", resp.GetError())
	}
	for _, f := range resp.File {
		path := filepath.Join(out, f.GetName())
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(path, []byte(f.GetContent()), 0o644); err != nil {
			return err
		}
	}
	return nil
}
